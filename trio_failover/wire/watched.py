"""Watched waits: a node silent for a response-header timeout is asked if it is alive.

An attempt may legitimately wait long for some answers: the head of an
unstreamed request (the node sends it with the whole answer), or the first
body byte after a head with first-body-timeout ``0`` (a long prefill). Such
a wait is a loop of response-header-timeout windows (``wait_watched``):
when one ends in silence the node is asked (``Liveness``: one ``GET
/health`` on a connection of its own, run by the proxy) and the wait goes on
only if it answered (SPEC 5.5). ``upstream.py`` runs the first window of the
head wait itself, as any head wait, and hands over here only when it ended;
``first_body_watched`` does the same for the first body byte. The common
request never gets past its first window.

The decisions are ``core/liveness.py``'s; the checks are
``proxy/liveness.py``'s, passed down as a protocol (wire imports no proxy).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import h11
import trio

from ..core import errors
from ..core.config import Config, Upstream
from ..core.liveness import Step, after_check, at_window_end, window_end
from ..core.outcome import Outcome
from .http1 import EarlyClose, gather_data, next_event, read_body, read_chunk
from .upstream_errors import IO_ERRORS, map_error, mapped

_T = TypeVar("_T")


class Liveness(Protocol):
    """Asks a node that keeps an attempt waiting whether it answers at all (SPEC 5.5)."""

    async def still_alive(self, node: Upstream) -> bool:
        """True if the node answered a liveness check (or one that passed just now).

        Never raises an ``UpstreamError``: a check that fails says False.
        """
        ...


async def wait_watched(
    node: Upstream,
    read: Callable[[], Awaitable[_T]],
    *,
    liveness: Liveness,
    config: Config,
    final_deadline: float,
    phase: str,
    waited_since: float,
) -> tuple[_T, int]:
    """Go on waiting for ``read`` after its first window ended; its result and the checks asked.

    The caller ran the first response-header-timeout window itself (the
    common request never gets here). Each round asks ``liveness`` and, if
    the node answered, reads on for one more window from the answer on;
    ``read`` must be safe to call again after a cancelled call (h11 and a
    cancelled receive lose no bytes).

    Raises:
        Unresponsive: a check got no answer (the node cools down, SPEC 5.5).
        HeaderTimeout: ``final_deadline`` passed (the unstreamed timeout),
            the checks having passed.

    Cancellation:
        A check in progress is given up with the waiting attempt
        (``proxy/liveness.py`` closes its connection).
    """
    header_timeout = config.response_header_timeout
    checks = 0
    now = trio.current_time()
    decision = at_window_end(now, final_deadline)
    while decision.step is Step.CHECK:
        alive = True  # unless the check says otherwise before the final deadline
        with trio.move_on_at(final_deadline):
            alive = await liveness.still_alive(node)
        checks += 1
        now = trio.current_time()
        # Cut by the final deadline: the node had its whole time (header_timeout).
        decision = after_check(alive or now >= final_deadline, now, final_deadline)
        if decision.step is not Step.WAIT:
            break
        with trio.CancelScope(deadline=window_end(now, header_timeout, final_deadline)) as scope:
            result = await read()
        if not scope.cancelled_caught:
            return result, checks
        now = trio.current_time()
        decision = at_window_end(now, final_deadline)
    waited = now - waited_since
    error: errors.UpstreamError
    if decision.outcome is Outcome.UNRESPONSIVE:
        error = errors.Unresponsive(
            node.name, phase, f"silent for {waited:.3g}s and no answer to GET /health"
        )
    else:
        error = errors.HeaderTimeout(
            node.name,
            phase,
            f"no complete response head in {config.unstreamed_timeout:g}s"
            f" ({checks} liveness checks passed)",
        )
    error.checks = checks
    raise error


async def first_body_watched(
    node: Upstream,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    config: Config,
    liveness: Liveness,
) -> tuple[bytes, bool, int]:
    """``first_body`` without a first-body timeout, watched; also the checks asked.

    The first body bytes nearly always came with the head: h11 holds them
    and nothing waits (no cancel scope on the common path). Else each
    response-header timeout of silence asks the node (``wait_watched``):
    a node that answers its check keeps the attempt however long its
    prefill runs; one that does not is ``Unresponsive``.
    """
    name = node.name
    try:
        ready = _parsed_body(conn)
    except (EarlyClose, h11.RemoteProtocolError) as exc:
        raise map_error(name, "first body byte", exc) from exc
    if ready is not None:
        return ready[0], ready[1], 0
    waited_since = trio.current_time()
    with trio.move_on_after(config.response_header_timeout) as scope:
        try:
            first, complete, _ = await read_chunk(stream, conn, starved=True)
        except (EarlyClose, *IO_ERRORS) as exc:
            raise map_error(name, "first body byte", exc) from exc
        return first, complete, 0

    async def read() -> tuple[bytes, bool]:
        with mapped(name, "first body byte"):
            return await read_body(stream, conn)

    assert scope.cancelled_caught
    (first, complete), checks = await wait_watched(
        node,
        read,
        liveness=liveness,
        config=config,
        final_deadline=math.inf,
        phase="first body byte",
        waited_since=waited_since,
    )
    return first, complete, checks


def _parsed_body(conn: h11.Connection) -> tuple[bytes, bool] | None:
    """The first body bytes and whether they end it, if h11 has them parsed; None: a read is due.

    ``http1.read_chunk`` without its read: the events h11 can make of what
    came with the head, taken together (a small answer is one write).
    """
    event = conn.next_event()
    if event is h11.NEED_DATA:
        return None
    # Data first: h11's events are ABCs, and isinstance of another class
    # than the event's own takes the slow path.
    if not isinstance(event, h11.Data):
        if isinstance(event, h11.EndOfMessage):
            return b"", True
        raise EarlyClose("connection closed in the body")
    if not event.data:
        return None  # h11 makes no empty Data; were it to, the read finds the next
    data, ended, _ = gather_data(conn, event.data)
    return data, ended


async def head_watched(
    node: Upstream,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    config: Config,
    liveness: Liveness,
    written: float,
    start: Callable[[trio.abc.Stream, h11.Connection], Awaitable[None]] | None,
) -> tuple[h11.Event, int]:
    """An unstreamed request's head after its first window: watched, to the unstreamed timeout.

    ``start``: the first read of a pooled connection, if it is still due
    (it tells a stale connection from a node that answers, ``upstream.py``).
    Returns the event after the informational responses, and the checks asked.
    """
    name = node.name
    first_read = [start]

    async def read() -> h11.Event:
        try:
            if first_read[0] is not None:
                await first_read[0](stream, conn)
                first_read[0] = None
            event = await next_event(stream, conn)
            while isinstance(event, h11.InformationalResponse):
                event = await next_event(stream, conn)
        except (EarlyClose, *IO_ERRORS) as exc:
            raise map_error(name, "head", exc) from exc
        return event

    return await wait_watched(
        node,
        read,
        liveness=liveness,
        config=config,
        final_deadline=written + config.unstreamed_timeout,
        phase="head",
        waited_since=written,
    )
