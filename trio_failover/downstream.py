"""The client side of one connection: h11 server, request reading, response
writing, and the byte reader that doubles as the close watcher.

One reader task per connection receives from the client for the whole
connection lifetime, so a FIN or an RST is seen at any moment, also while an
upstream attempt is pending or a committed stream is silent. Received bytes
are kept (never consumed by the watcher) until the h11 connection asks for
them, so a pipelined next request survives. The reader stops receiving once
``PENDING_LIMIT`` bytes wait: it never reads without bound.

A single long-lived reader also means ``receive_some`` is never cancelled in
the middle of a request, which matters for TLS streams.
"""

from __future__ import annotations

import contextlib
import enum
import json
from http import HTTPStatus

import attrs
import h11
import trio

from .errors import ClientError

RECEIVE_SIZE = 65536
PENDING_LIMIT = 65536


class ClientGone(Exception):
    """The client connection broke while the proxy was writing to it."""


class Closed(enum.Enum):
    """How the client's side of the connection ended."""

    EOF = "eof"  # FIN: the client closed (or half-closed) its sending side
    RESET = "reset"  # RST or another socket error


@attrs.frozen
class ClientRequest:
    """One complete request from the client, with its body buffered."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    http_version: bytes


class ClientConnection:
    """h11 server state plus a bounded receive buffer for one client stream."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_head: int,
        max_body: int,
        client_header_timeout: float,
    ) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
        self._max_body = max_body
        self._max_head = max_head
        self._fed = 0  # bytes moved into h11 since the current head began
        self._header_timeout = client_header_timeout
        self._pending = bytearray()
        self.closed: Closed | None = None
        self._closed_event = trio.Event()
        self._arrived = trio.Event()
        self._room = trio.Event()
        self.requests_read = 0

    # -- the reader task -----------------------------------------------------

    async def run_reader(self) -> None:
        """Receive client bytes until EOF or error; run in the connection's nursery."""
        try:
            while True:
                while len(self._pending) >= PENDING_LIMIT:
                    self._room = trio.Event()
                    await self._room.wait()
                data = await self.stream.receive_some(RECEIVE_SIZE)
                if not data:
                    self.closed = Closed.EOF
                    return
                self._pending += data
                self._wake()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = Closed.RESET
        finally:
            self._closed_event.set()
            self._wake()

    def _wake(self) -> None:
        self._arrived.set()
        self._arrived = trio.Event()

    async def wait_closed(self) -> Closed:
        """Wait until the client's side ends; returns how (FIN or RST)."""
        await self._closed_event.wait()
        assert self.closed is not None
        return self.closed

    def _feed(self) -> None:
        """Move pending bytes into h11 (and EOF once everything is in)."""
        if self._pending:
            self._fed += len(self._pending)
            self.conn.receive_data(bytes(self._pending))
            self._pending.clear()
            self._room.set()
        elif self.closed is not None:
            self.conn.receive_data(b"")

    async def _next_event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            if self.closed is not None and not self._pending:
                if self.conn.their_state is h11.CLOSED:
                    return h11.ConnectionClosed()
                self._feed()
                continue
            await self.wait_input()
            self._feed()

    # -- reading requests ----------------------------------------------------

    def prepare_next(self) -> bool:
        """Get h11 ready for the next request; False when none may follow."""
        conn = self.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        return conn.our_state is h11.IDLE and conn.their_state is h11.IDLE

    def has_buffered(self) -> bool:
        """Whether request bytes (or the client's close) wait to be read."""
        return bool(self._pending) or bool(self.conn.trailing_data[0]) or self.closed is not None

    async def wait_input(self) -> None:
        """Wait until bytes are pending or the client's side has ended."""
        while not self._pending and self.closed is None:
            await self._arrived.wait()

    async def read_request(self) -> ClientRequest | None:
        """The next complete request, or None when the client closed between requests.

        The whole head must arrive within the header timeout; the body may
        pause at most one header timeout between its bytes.

        Raises:
            ClientError: 400 malformed, 408 too slow, 413 body too large,
                431 head too large.
        """
        already_buffered = len(self.conn.trailing_data[0])
        self._fed = 0
        with trio.move_on_after(self._header_timeout) as head_scope:
            try:
                event = await self._next_event()
            except h11.RemoteProtocolError as exc:
                raise _client_error(exc) from exc
        if head_scope.cancelled_caught:
            raise ClientError(408, "the request head did not arrive in time", "request_timeout")
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise ClientError(400, "malformed request", "bad_request")
        # h11 enforces its size limit only while a head is incomplete: a head
        # that crosses the limit and ends in the same read would pass. Count.
        head_size = already_buffered + self._fed - len(self.conn.trailing_data[0])
        if head_size > self._max_head:
            raise ClientError(431, "request header fields too large", "headers_too_large")
        names = {name for name, _ in event.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            # RFC 9112 section 6.3: a proxy that forwarded such a message
            # could be made to disagree with the node about where it ends.
            raise ClientError(400, "Content-Length together with Transfer-Encoding", "bad_request")
        self.requests_read += 1
        body = await self._read_body(event)
        return ClientRequest(
            method=event.method,
            target=event.target,
            headers=list(event.headers),
            body=body,
            http_version=event.http_version,
        )

    async def _read_body(self, request: h11.Request) -> bytes:
        for name, value in request.headers:
            if name == b"content-length" and int(value) > self._max_body:
                raise ClientError(413, "request body too large", "request_too_large")
        if self.conn.they_are_waiting_for_100_continue:
            await self.send(h11.InformationalResponse(status_code=100, headers=[]))
        parts: list[bytes] = []
        size = 0
        while True:
            # Between body bytes the client gets one header timeout of silence.
            with trio.move_on_after(self._header_timeout) as scope:
                try:
                    event = await self._next_event()
                except h11.RemoteProtocolError as exc:
                    raise _client_error(exc) from exc
            if scope.cancelled_caught:
                raise ClientError(408, "the request body stalled", "request_timeout")
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self._max_body:
                    raise ClientError(413, "request body too large", "request_too_large")
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            else:
                raise ClientError(400, "request body incomplete", "bad_request")

    # -- writing responses ---------------------------------------------------

    async def send(self, *events: h11.Event) -> None:
        """Send h11 events in one write.

        Raises:
            ClientGone: the client connection broke.
        """
        data = b"".join(self.conn.send(event) or b"" for event in events)
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.conn.send_failed()
            raise ClientGone(str(exc)) from exc

    async def send_json(
        self,
        status: int,
        document: dict[str, object],
        headers: list[tuple[bytes, bytes]] | None = None,
        *,
        close: bool = False,
    ) -> None:
        """Send a complete JSON response."""
        body = json.dumps(document).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        head += headers or []
        if close:
            head.append((b"connection", b"close"))
        await self.send(
            h11.Response(status_code=status, reason=_phrase(status), headers=head),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )

    async def send_client_error(self, error: ClientError) -> None:
        """Answer a bad request with its JSON error; the connection then closes."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        document: dict[str, object] = {
            "error": {"message": str(error), "type": "invalid_request_error", "code": error.code}
        }
        with contextlib.suppress(ClientGone, h11.LocalProtocolError):
            await self.send_json(error.status, document, close=True)

    @property
    def reusable(self) -> bool:
        """Whether another request may follow on this connection."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    async def aclose(self) -> None:
        """Close the connection (abortive, never blocks)."""
        await trio.aclose_forcefully(self.stream)


def _phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _client_error(exc: h11.RemoteProtocolError) -> ClientError:
    status = exc.error_status_hint
    if status == 431:
        return ClientError(431, "request header fields too large", "headers_too_large")
    return ClientError(400, f"malformed request: {exc}", "bad_request")
