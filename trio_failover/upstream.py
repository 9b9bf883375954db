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
socket is closed at once in ``finally``; no socket outlives its attempt.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import attrs
import h11
import trio

from . import errors, sockopts
from .config import Config, Upstream
from .headers import Headers
from .outcome import HeadAction, SavedResponse, classify_head, error_code

RECEIVE_SIZE = 65536
# A 4xx error body is read up to this size to look for a retryable
# error.code; a retryable status keeps this much to relay if it is the last
# answer. Anything longer is not an error body worth holding.
ERROR_BODY_LIMIT = 65536


class Connector(Protocol):
    """Opens a byte stream to a node. Swap it to run the proxy in memory."""

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        """Open a connection to ``node``; raise OSError (or ssl.SSLError) on failure."""
        ...


class TCPConnector:
    """The real connector: TCP (plus TLS for https:// nodes) with socket options."""

    def __init__(self, config: Config) -> None:
        self._dead_peer_timeout = config.dead_peer_timeout
        self._ssl_contexts: dict[str, ssl.SSLContext] = {}

    def ssl_context(self, node: Upstream) -> ssl.SSLContext:
        """The TLS context for an https:// node (verifying unless configured not to)."""
        context = self._ssl_contexts.get(node.name)
        if context is None:
            context = ssl.create_default_context(cafile=node.ca_file)
            if node.insecure_skip_verify:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            context.set_alpn_protocols(["http/1.1"])
            self._ssl_contexts[node.name] = context
        return context

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        """TCP connect, socket options, and the TLS handshake for https:// nodes."""
        tcp = await trio.open_tcp_stream(node.host, node.port)
        sockopts.apply_upstream_options(tcp.socket, self._dead_peer_timeout)
        if node.scheme != "https":
            return tcp
        tls = trio.SSLStream(tcp, self.ssl_context(node), server_hostname=node.host)
        try:
            await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return tls


@attrs.frozen
class OutgoingRequest:
    """The request as one node receives it (headers already made for that node)."""

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


@contextmanager
def _mapped(node: str, phase: str) -> Iterator[None]:
    """Map Trio, OS, TLS and h11 errors of one phase onto the error tree."""
    try:
        yield
    except _EarlyClose as exc:
        raise errors.UpstreamClosedEarly(node, f"{phase}: {exc}") from exc
    except h11.RemoteProtocolError as exc:
        raise errors.UpstreamProtocolError(node, f"{phase}: {exc}") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        if sockopts.is_dead_peer_error(exc):
            raise errors.DeadPeer(node, f"{phase}: peer stopped answering") from exc
        if _caused_by(exc, ssl.SSLError):
            raise errors.TLSError(node, f"{phase}: {exc.__cause__ or exc}") from exc
        raise errors.UpstreamReset(node, f"{phase}: {exc.__cause__ or exc}") from exc


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

    The rest of the body comes from ``receive_chunk``. Close it with
    ``aclose`` (it closes the socket; connections are not reused after a
    response that was not read to its end).
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

    async def receive_chunk(self) -> bytes | None:
        """The next body bytes, or None at the end of the body.

        Raises:
            UpstreamError: the connection broke or the node sent bad framing.
        """
        if self.complete:
            return None
        while True:
            with _mapped(self.node.name, "body"):
                event = await _next_event(self._stream, self._conn)
            if isinstance(event, h11.Data):
                if event.data:
                    return bytes(event.data)
                continue
            if isinstance(event, h11.EndOfMessage):
                self.complete = True
                return None
            raise errors.UpstreamClosedEarly(self.node.name, "body: connection closed")

    async def aclose(self) -> None:
        """Close the connection to the node, forcefully (never blocks)."""
        await trio.aclose_forcefully(self._stream)


class _EarlyClose(Exception):
    """The node closed the connection before the message was complete."""


async def _next_event(stream: trio.abc.Stream, conn: h11.Connection) -> h11.Event:
    """The next h11 event, receiving from ``stream`` as needed.

    An EOF that cuts a message short is an early close (a fast failure), not
    a protocol error, although h11 reports it as one.
    """
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            assert not isinstance(event, type)  # PAUSED is never returned to a client
            return event
        data = await stream.receive_some(RECEIVE_SIZE)
        conn.receive_data(bytes(data))
        if not data:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _EarlyClose("connection closed mid-message") from exc
            if event is h11.NEED_DATA or isinstance(event, (h11.ConnectionClosed, type)):
                raise _EarlyClose("connection closed")
            return event


async def open_response(
    node: Upstream, request: OutgoingRequest, *, connector: Connector, config: Config
) -> UpstreamResponse:
    """Run one attempt up to the commit point.

    Returns:
        The response with its head and first body bytes (or its valid empty
        end); nothing has been sent to the client yet.

    Raises:
        UpstreamError: a subclass naming the phase and outcome of the failure;
            ``RetryableResponse`` carries the node's answer in ``.saved``.

    Cancellation:
        Cancelling closes the connection at once; nothing is left open.
    """
    started = trio.current_time()
    with trio.move_on_after(config.connect_timeout) as connect_scope:
        try:
            stream = await connector.connect(node)
        except ssl.SSLError as exc:
            raise errors.TLSError(node.name, f"connect: {exc}") from exc
        except (OSError, trio.BrokenResourceError) as exc:
            if _caused_by(exc, ssl.SSLError):
                raise errors.TLSError(node.name, f"connect: {exc.__cause__}") from exc
            raise errors.ConnectFailed(node.name, f"connect: {exc}") from exc
    if connect_scope.cancelled_caught:
        raise errors.ConnectTimeout(
            node.name, f"connect: no connection in {config.connect_timeout}s"
        )
    try:
        return await _exchange(node, stream, request, config, started)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def _exchange(
    node: Upstream,
    stream: trio.abc.Stream,
    request: OutgoingRequest,
    config: Config,
    started: float,
) -> UpstreamResponse:
    conn = h11.Connection(h11.CLIENT)
    name = node.name
    header_timeout = config.response_header_timeout

    # A node that does not even take the request is as stalled as one that
    # takes it and never answers: the same deadline bounds the write.
    with trio.move_on_after(header_timeout) as write_scope, _mapped(name, "write"):
        head = conn.send(
            h11.Request(method=request.method, target=request.target, headers=request.headers)
        )
        body = conn.send(h11.Data(data=request.body)) if request.body else b""
        end = conn.send(h11.EndOfMessage())
        if len(request.body) <= RECEIVE_SIZE:
            await stream.send_all(head + body + end)
        else:  # do not copy a large body just to save a syscall
            await stream.send_all(head)
            await stream.send_all(body)
            await stream.send_all(end)
    if write_scope.cancelled_caught:
        raise errors.HeaderTimeout(name, f"write: request not taken in {header_timeout}s")
    written = trio.current_time()

    # Head: from the request fully written to the whole head read, 1xx skipped.
    with trio.move_on_after(header_timeout) as head_scope, _mapped(name, "head"):
        event = await _next_event(stream, conn)
        while isinstance(event, h11.InformationalResponse):
            event = await _next_event(stream, conn)
    if head_scope.cancelled_caught:
        raise errors.HeaderTimeout(name, f"head: no complete response head in {header_timeout}s")
    if not isinstance(event, h11.Response):
        raise errors.UpstreamProtocolError(name, f"head: unexpected {type(event).__name__}")
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
            raise errors.HeaderTimeout(name, "error body: stalled after the head")
        code = error_code(body_bytes) if complete else None
        if action is HeadAction.RETRY or (code is not None and code in config.retry_error_codes):
            saved = SavedResponse(
                node=name,
                status=response.status_code,
                reason=response.reason,
                headers=list(response.headers),
                body=body_bytes,
            )
            detail = f"answered {response.status_code}" + (f" {code}" if code else "")
            raise errors.RetryableResponse(name, detail, saved)
        timings = Timings(started, written, head_at, trio.current_time())
        return UpstreamResponse(node, stream, conn, response, body_bytes, complete, timings)

    # First body byte: unbounded unless the operator opted in, because a
    # node may send its head at once and then prefill for minutes.
    first_body_timeout = config.first_body_timeout or float("inf")
    with trio.move_on_after(first_body_timeout) as first_scope, _mapped(name, "first body byte"):
        first, complete = await _read_first(stream, conn)
    if first_scope.cancelled_caught:
        raise errors.FirstBodyTimeout(name, f"no body byte {config.first_body_timeout}s after head")
    timings = Timings(started, written, head_at, trio.current_time())
    return UpstreamResponse(node, stream, conn, response, first, complete, timings)


async def _read_first(stream: trio.abc.Stream, conn: h11.Connection) -> tuple[bytes, bool]:
    """The first non-empty body bytes, or b"" with complete=True for an empty body."""
    while True:
        event = await _next_event(stream, conn)
        if isinstance(event, h11.Data):
            if event.data:
                return bytes(event.data), False
        elif isinstance(event, h11.EndOfMessage):
            return b"", True
        else:
            raise _EarlyClose("connection closed before the first body byte")


async def _read_prefix(
    stream: trio.abc.Stream, conn: h11.Connection, limit: int
) -> tuple[bytes, bool]:
    """Up to about ``limit`` body bytes; complete=True when the body ended within them."""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        event = await _next_event(stream, conn)
        if isinstance(event, h11.Data):
            parts.append(bytes(event.data))
            size += len(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(parts), True
        else:
            raise _EarlyClose("connection closed in the error body")
    return b"".join(parts), False
