"""One attempt at one node: connect, write the request, read the head, wait
for the first body byte. Then, after commit, the rest of the body.

Each deadline wraps the smallest operation that owns it:

    connect (+TLS)         connect_timeout           -> ConnectTimeout
    write request          response_header_timeout   -> HeaderTimeout
    read the whole head    response_header_timeout   -> HeaderTimeout
    head -> first byte     first_body_timeout (opt)  -> FirstBodyTimeout

Trio and OS errors are turned into ``UpstreamError`` subclasses here, phase
by phase; what they mean for the workload is ``outcome.judge``'s call.
Cancellation: whatever cancels an attempt (client abort, shutdown), its
socket is closed at once; only a connection whose response was relayed to
its end goes back to the node's pool (``pool.py``) instead.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import h11
import trio

from ..core import errors
from ..core.config import Config, Upstream
from ..core.headers import Headers
from ..core.outcome import HeadAction, SavedResponse, classify_head, error_code, fails_over_on
from . import sockopts
from .connect import Connector, TCPConnector, open_tcp
from .http1 import RECEIVE_SIZE, EarlyClose, next_event
from .pool import ConnectionPool

__all__ = [
    "Connector",
    "OutgoingRequest",
    "TCPConnector",
    "Timings",
    "UpstreamResponse",
    "open_response",
    "open_tcp",
]

# A 4xx error body is read up to this size to look for a retryable
# error.code; a retryable status keeps this much to relay if it is the last
# answer. Anything longer is not an error body worth holding.
ERROR_BODY_LIMIT = 65536


@attrs.frozen
class OutgoingRequest:
    """The request as one node receives it (headers already made for that node).

    Its parts are sent without h11's header checks, so they must be valid
    already: the client's method, target and headers passed h11's parser;
    the node's URL parts, its header names and values, and node names passed
    the checks of ``config``; the rest is the proxy's own (a workload id that
    matched its pattern, an address, digits). h11 still checks the method,
    the target and the Host header.
    """

    method: bytes
    target: bytes
    headers: Headers
    body: bytes


@attrs.frozen
class Timings:
    """Trio-clock times of one attempt's milestones."""

    started: float
    written: float
    head: float
    first_body: float


_IO_ERRORS = (
    h11.RemoteProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


def _map_error(node: str, phase: str, exc: BaseException) -> errors.UpstreamError:
    """The error-tree form of a Trio, OS, TLS or h11 error of one phase."""
    if isinstance(exc, EarlyClose):
        return errors.UpstreamClosedEarly(node, phase, f"{exc}")
    if isinstance(exc, h11.RemoteProtocolError):
        return errors.UpstreamProtocolError(node, phase, f"{exc}")
    if sockopts.is_dead_peer_error(exc):
        return errors.DeadPeer(node, phase, "peer stopped answering")
    if _caused_by(exc, ssl.SSLError):
        return errors.TLSError(node, phase, f"{exc.__cause__ or exc}")
    return errors.UpstreamReset(node, phase, f"{exc.__cause__ or exc}")


@contextmanager
def _mapped(node: str, phase: str) -> Iterator[None]:
    """Map Trio, OS, TLS and h11 errors of one phase onto the error tree."""
    try:
        yield
    except (EarlyClose, *_IO_ERRORS) as exc:
        raise _map_error(node, phase, exc) from exc


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):  # a cause chain is short; bound the walk anyway
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class UpstreamResponse:
    """A committed-ready response: its whole head and its first body bytes.

    The rest of the body comes from ``receive_chunk``. When the body was
    relayed to its end, ``release`` hands the connection back to the pool
    (if it may carry another request); otherwise ``aclose`` closes it. A
    response that was not read to its end is never pooled.
    """

    def __init__(
        self,
        node: Upstream,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        response: h11.Response,
        first_chunk: bytes,
        complete: bool,
        timings: Timings,
        pool: ConnectionPool | None = None,
    ) -> None:
        self.node = node
        self.status = response.status_code
        self.reason = response.reason
        self.headers: Headers = list(response.headers)
        self.first_chunk = first_chunk
        self.complete = complete
        self.timings = timings
        self._stream = stream
        self._conn = conn
        self._pool = pool
        self._open = True

    async def receive_chunk(self) -> bytes:
        """The next body bytes: all that has arrived, at least one byte.

        After it returns, ``complete`` tells whether the body has ended (the
        bytes returned are then its last, possibly none). Bytes that came in
        one read are returned together, so a burst of small upstream chunks
        costs one client write, never a wait.

        Raises:
            UpstreamError: the connection broke or the node sent bad framing.
        """
        if self.complete:
            return b""
        try:
            data, self.complete = await _read_body(self._stream, self._conn)
        except (EarlyClose, *_IO_ERRORS) as exc:
            raise _map_error(self.node.name, "body", exc) from exc
        return data

    async def release(self) -> None:
        """Give the connection back to the pool after a complete response, else close it.

        Cancellation: the connection is pooled or closed, never left open.
        """
        if not self._open:
            return
        self._open = False
        if self._pool is not None:  # it checks that the exchange ended cleanly
            await self._pool.release(self.node.name, self._stream, self._conn)
        else:
            await trio.aclose_forcefully(self._stream)

    async def aclose(self) -> None:
        """Close the connection to the node, forcefully (never blocks)."""
        if self._open:
            self._open = False
            await trio.aclose_forcefully(self._stream)


class _StaleConnection(Exception):
    """A pooled connection was closed by the node before any byte of the answer."""


async def _receive_answer_start(stream: trio.abc.Stream, conn: h11.Connection) -> None:
    """First read on a pooled connection: an EOF or reset here means it went stale.

    A node closes an idle keep-alive connection whenever its own timer says
    so; if that crosses our request, nothing of it was processed and the
    request can go out again on a fresh connection (RFC 9112 section 9.3.1).

    Raises:
        _StaleConnection: EOF or reset before the first byte.
    """
    try:
        data = await stream.receive_some(RECEIVE_SIZE)
    except (trio.BrokenResourceError, OSError) as exc:
        if sockopts.is_dead_peer_error(exc):
            raise  # the peer vanished: a node failure, found by keepalive
        raise _StaleConnection("reset before the answer") from exc
    if not data:
        raise _StaleConnection("closed before the answer")
    conn.receive_data(bytes(data))


async def _connect(node: Upstream, connector: Connector, config: Config) -> trio.abc.Stream:
    with trio.move_on_after(config.connect_timeout) as connect_scope:
        try:
            return await connector.connect(node)
        except ssl.SSLError as exc:
            raise errors.TLSError(node.name, "connect", f"{exc}") from exc
        except (OSError, trio.BrokenResourceError) as exc:
            if _caused_by(exc, ssl.SSLError):
                raise errors.TLSError(node.name, "connect", f"{exc.__cause__}") from exc
            raise errors.ConnectFailed(node.name, "connect", f"{exc}") from exc
    assert connect_scope.cancelled_caught
    raise errors.ConnectTimeout(node.name, "connect", f"no connection in {config.connect_timeout}s")


async def open_response(
    node: Upstream,
    request: OutgoingRequest,
    *,
    connector: Connector,
    config: Config,
    pool: ConnectionPool | None = None,
) -> UpstreamResponse:
    """Run one attempt up to the commit point.

    With a ``pool``, the newest idle connection to the node is used first.
    If it turns out closed before any byte of the answer (EOF or reset on
    the write or the first read), the request goes out once more on a fresh
    connection, within the same attempt: not a node failure, no cooldown.
    The response-header deadline runs from the request written on the
    connection actually used.

    Returns:
        The response with its head and first body bytes (or its valid empty
        end); nothing has been sent to the client yet.

    Raises:
        UpstreamError: a subclass naming the phase and outcome of the failure;
            ``RetryableResponse`` carries the node's answer in ``.saved``
            (None when its body exceeded ``ERROR_BODY_LIMIT``).

    Cancellation:
        Cancelling closes the connection at once; nothing is left open and
        nothing goes back to the pool.
    """
    started = trio.current_time()
    if pool is not None:
        idle = await pool.acquire(node.name)
        if idle is not None:
            try:
                return await _exchange(
                    node, idle.stream, idle.conn, request, config, started, pool, reused=True
                )
            except _StaleConnection:
                pass  # closed below, outside the handler; then a fresh connection
            except BaseException:
                await trio.aclose_forcefully(idle.stream)
                raise
            await trio.aclose_forcefully(idle.stream)
    stream = await _connect(node, connector, config)
    try:
        return await _exchange(
            node, stream, h11.Connection(h11.CLIENT), request, config, started, pool, reused=False
        )
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def _exchange(
    node: Upstream,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    request: OutgoingRequest,
    config: Config,
    started: float,
    pool: ConnectionPool | None,
    *,
    reused: bool,
) -> UpstreamResponse:
    name = node.name
    header_timeout = config.response_header_timeout

    # One scope, two deadlines of the same length: first for the write (a
    # node that does not even take the request is as stalled as one that
    # takes it and never answers), then, moved, from the request fully
    # written to the whole head read, 1xx skipped.
    phase = "write"
    written = 0.0
    with trio.move_on_after(header_timeout) as scope:
        try:
            # _parsed: skip h11's header regexes; OutgoingRequest documents
            # why its parts are valid already.
            head = conn.send(
                h11.Request(
                    method=request.method,
                    target=request.target,
                    headers=request.headers,
                    _parsed=True,
                )
            )
            body = conn.send(h11.Data(data=request.body)) if request.body else b""
            end = conn.send(h11.EndOfMessage())
            if len(request.body) <= RECEIVE_SIZE:
                await stream.send_all(head + body + end)
            else:  # do not copy a large body just to save a syscall
                await stream.send_all(head)
                await stream.send_all(body)
                await stream.send_all(end)
            written = trio.current_time()
            scope.deadline = written + header_timeout
            phase = "head"
            if reused:
                await _receive_answer_start(stream, conn)
            event = await next_event(stream, conn)
            while isinstance(event, h11.InformationalResponse):
                event = await next_event(stream, conn)
        except (trio.BrokenResourceError, OSError) as exc:
            if reused and phase == "write" and not sockopts.is_dead_peer_error(exc):
                raise _StaleConnection("broken on write") from exc
            raise _map_error(name, phase, exc) from exc
        except (EarlyClose, h11.RemoteProtocolError, trio.ClosedResourceError) as exc:
            raise _map_error(name, phase, exc) from exc
    if scope.cancelled_caught:
        if phase == "write":
            raise errors.HeaderTimeout(name, "write", f"request not taken in {header_timeout}s")
        raise errors.HeaderTimeout(name, "head", f"no complete response head in {header_timeout}s")
    if not isinstance(event, h11.Response):
        raise errors.UpstreamProtocolError(name, "head", f"unexpected {type(event).__name__}")
    response = event
    head_at = trio.current_time()

    action = classify_head(
        response.status_code,
        retry_status=config.retry_status,
        retry_error_codes=config.retry_error_codes,
    )
    if action is not HeadAction.COMMIT:
        # A short error body decides; it must come within one more header
        # duration (a node that sends "503" and stalls is still stalled).
        with trio.move_on_after(header_timeout) as body_scope, _mapped(name, "error body"):
            body_bytes, complete = await _read_prefix(stream, conn, ERROR_BODY_LIMIT)
        if body_scope.cancelled_caught:
            raise errors.HeaderTimeout(name, "error body", "stalled after the head")
        code = error_code(body_bytes) if complete else None
        if fails_over_on(action, code, config.retry_error_codes):
            headers = list(response.headers)
            saved = (
                SavedResponse(
                    node=name,
                    status=response.status_code,
                    reason=response.reason,
                    headers=headers,
                    body=body_bytes,
                )
                if complete
                else None
            )
            detail = f"answered {response.status_code}" + (f" {code}" if code else "")
            raise errors.RetryableResponse(
                name, "head", detail, response.status_code, headers, saved
            )
        timings = Timings(started, written, head_at, trio.current_time())
        return UpstreamResponse(node, stream, conn, response, body_bytes, complete, timings, pool)

    # First body byte: unbounded unless the operator opted in, because a
    # node may send its head at once and then prefill for minutes.
    if config.first_body_timeout:
        with (
            trio.move_on_after(config.first_body_timeout) as first_scope,
            _mapped(name, "first body byte"),
        ):
            first, complete = await _read_body(stream, conn)
        if first_scope.cancelled_caught:
            raise errors.FirstBodyTimeout(
                name, "first body byte", f"no body byte {config.first_body_timeout}s after head"
            )
    else:
        try:
            first, complete = await _read_body(stream, conn)
        except (EarlyClose, *_IO_ERRORS) as exc:
            raise _map_error(name, "first body byte", exc) from exc
    timings = Timings(started, written, head_at, trio.current_time())
    return UpstreamResponse(node, stream, conn, response, first, complete, timings, pool)


async def _read_body(stream: trio.abc.Stream, conn: h11.Connection) -> tuple[bytes, bool]:
    """The next body bytes (at least one) and whether the body ended with them.

    Returns ``(b"", True)`` at the end of the body. After the first bytes,
    the events h11 can parse from what already arrived are taken too, without
    another read: coalescing them delays nothing, and a small answer that
    came in one segment is then relayed in one write, its end included.
    """
    while True:
        event = await next_event(stream, conn)
        if isinstance(event, h11.Data):
            if event.data:
                break
        elif isinstance(event, h11.EndOfMessage):
            return b"", True
        else:
            raise EarlyClose("connection closed in the body")
    data = event.data  # h11's own copy: relayed as is, not copied again
    parts: list[bytes] | None = None
    ended = False
    try:
        while True:
            more = conn.next_event()
            if isinstance(more, h11.Data):
                if parts is None:
                    parts = [data]
                parts.append(more.data)
            else:
                ended = isinstance(more, h11.EndOfMessage)
                break  # NEED_DATA: nothing more yet
    except h11.RemoteProtocolError:
        pass  # h11 stays in ERROR and raises again on the next read
    return (data if parts is None else b"".join(parts)), ended


async def _read_prefix(
    stream: trio.abc.Stream, conn: h11.Connection, limit: int
) -> tuple[bytes, bool]:
    """Up to about ``limit`` body bytes; complete=True when the body ended within them."""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        event = await next_event(stream, conn)
        if isinstance(event, h11.Data):
            parts.append(bytes(event.data))
            size += len(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(parts), True
        else:
            raise EarlyClose("connection closed in the error body")
    return b"".join(parts), False
