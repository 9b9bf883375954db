"""The proxy's own small requests to a node: ``GET`` one path, read a bounded answer.

The discovery checks (``GET /health``, ``/v1/models``, ``/api/tags``) and
the fleet-wide lists (``/v1/models``, ``/api/tags``) use it. It is not an
attempt: it takes no slot, counts in no node's ``in_flight`` and goes over
a fresh connection, never the request pool, so that a check tells whether
the node takes new connections now (a pooled one can outlive the listener
behind it) and never holds a connection a request could use. The node's
headers and TLS settings apply as for requests: the connection comes from
the same ``Connector``.

Deadlines: the connect timeout (``upstream``'s connect step, errors mapped
the same way), then ``answer_timeout`` from the connection made to the
whole answer read.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h11
import trio

from ..core import errors
from ..core.config import Config, Upstream
from ..core.requests import node_target
from ..core.version import __version__
from .connect import Connector
from .http1 import next_event, read_prefix, send_events
from .upstream import connect_node, mapped  # one connect step, one error mapper

USER_AGENT = f"trio-failover/{__version__}".encode()


@attrs.frozen
class Answer:
    """A node's answer to ``fetch``: status and the first bytes of its body."""

    status: int
    body: bytes
    complete: bool  # the whole body is in ``body``


def request_head(node: Upstream, path: bytes) -> h11.Request:
    """The ``GET`` of ``path`` below the node's base path, with the node's headers."""
    headers = [
        (b"host", node.host_header.encode()),
        (b"user-agent", USER_AGENT),
        (b"accept", b"application/json"),
        (b"connection", b"close"),  # one request per connection, never pooled
    ]
    headers += [(name.encode(), value.encode()) for name, value in node.headers.items()]
    return h11.Request(method=b"GET", target=node_target(path, node.base_path), headers=headers)


async def fetch(
    node: Upstream,
    path: bytes,
    *,
    connector: Connector,
    config: Config,
    answer_timeout: float,
    limit: int,
) -> Answer:
    """``GET path`` on a fresh connection to ``node``; the answer with up to ``limit`` body bytes.

    Raises:
        UpstreamError: ``ConnectFailed``, ``ConnectTimeout`` or ``TLSError``
            while connecting; ``HeaderTimeout`` when the whole answer did not
            come within ``answer_timeout``; ``UpstreamReset``,
            ``UpstreamClosedEarly`` or ``UpstreamProtocolError`` after.

    Cancellation:
        The connection is closed whatever happens, at once.
    """
    stream = await connect_node(node, connector, config)
    try:
        return await _exchange(stream, node, path, answer_timeout, limit)
    finally:
        await trio.aclose_forcefully(stream)


async def fetch_if(
    node: Upstream,
    path: bytes,
    *,
    send_if: Callable[[], bool],
    connector: Connector,
    config: Config,
    answer_timeout: float,
    limit: int,
) -> Answer | None:
    """``fetch``, but once connected, send only if ``send_if()`` still says so.

    For a question that must not reach the node while something else is
    under way there (the check's ``/v1/models`` while an attempt is in
    flight): asking right before the request goes out, not before the
    connect, leaves no time for an attempt to begin in between.

    Returns:
        The answer; None when ``send_if()`` said no (the connection is then
        closed, nothing sent).

    Raises:
        UpstreamError: as ``fetch``.
    """
    stream = await connect_node(node, connector, config)
    try:
        if not send_if():
            return None
        return await _exchange(stream, node, path, answer_timeout, limit)
    finally:
        await trio.aclose_forcefully(stream)


async def _exchange(
    stream: trio.abc.Stream, node: Upstream, path: bytes, answer_timeout: float, limit: int
) -> Answer:
    conn = h11.Connection(h11.CLIENT)
    with trio.move_on_after(answer_timeout) as scope, mapped(node.name, "answer"):
        head = await _ask_head(stream, conn, node, path)
        body, complete = await read_prefix(stream, conn, limit)
        return Answer(head.status_code, body, complete)
    # Only the deadline gets here.
    assert scope.cancelled_caught
    raise errors.HeaderTimeout(node.name, "answer", f"no whole answer in {answer_timeout}s")


async def fetch_head(
    node: Upstream,
    path: bytes,
    *,
    connector: Connector,
    config: Config,
    head_timeout: float,
) -> int:
    """``GET path`` on a fresh connection to ``node``; the status of its answer's head.

    Only the head is waited for, not the body: the liveness checks
    (docs/failover.md) ask whether the process answers at all, and any
    status says so.

    Raises:
        UpstreamError: ``ConnectFailed``, ``ConnectTimeout`` or ``TLSError``
            while connecting; ``HeaderTimeout`` when no whole head came within
            ``head_timeout`` of the connection made; ``UpstreamReset``,
            ``UpstreamClosedEarly`` or ``UpstreamProtocolError`` before it.

    Cancellation:
        The connection is closed whatever happens, at once.
    """
    stream = await connect_node(node, connector, config)
    try:
        conn = h11.Connection(h11.CLIENT)
        with trio.move_on_after(head_timeout) as scope, mapped(node.name, "answer"):
            return (await _ask_head(stream, conn, node, path)).status_code
    finally:
        await trio.aclose_forcefully(stream)
    # Only the deadline gets here.
    assert scope.cancelled_caught
    raise errors.HeaderTimeout(node.name, "answer", f"no response head in {head_timeout}s")


async def _ask_head(
    stream: trio.abc.Stream, conn: h11.Connection, node: Upstream, path: bytes
) -> h11.Response:
    """Send ``GET path`` and read its answer's final head (interim ``1xx`` skipped)."""
    await send_events(stream, conn, request_head(node, path), h11.EndOfMessage())
    event = await next_event(stream, conn)
    while isinstance(event, h11.InformationalResponse):
        event = await next_event(stream, conn)
    if not isinstance(event, h11.Response):
        raise errors.UpstreamProtocolError(
            node.name, "answer", f"unexpected {type(event).__name__}"
        )
    return event
