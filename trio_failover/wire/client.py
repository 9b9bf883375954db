"""The client side of one connection, its whole life: the request loop with
its keep-alive waits and deadlines, h11 server state, request reading,
response writing, and the byte reader that doubles as the close watcher.

One reader task per connection receives from the client for the whole
connection lifetime, so a FIN or an RST is seen at any moment, also while an
upstream attempt is pending or a committed stream is silent. Received bytes
are kept (never consumed by the watcher) until the h11 connection asks for
them, so a pipelined next request survives. The reader stops receiving once
``PENDING_LIMIT`` bytes wait: it never reads without bound.

A single long-lived reader also means ``receive_some`` is never cancelled in
the middle of a request, which matters for TLS streams.

Each request head is screened as raw bytes before h11 parses it, for what
h11 lets through but a proxy must not (RFC 9112 sections 2.2, 5.2 and 6.1;
request smuggling lives on two parsers disagreeing): an obs-fold, a bare CR
or LF, a head over the size limit even when it arrived whole. Each request
cycle gets a fresh h11 connection so that every head, also a pipelined one,
passes the screen: the bytes the previous connection received beyond its
message go back to the pending buffer.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import re
from collections.abc import Awaitable, Callable

import attrs
import h11
import trio

from ..core.answers import error_document
from ..core.errors import ClientError
from ..core.screen import check_framing, screen_head
from .drain import Drain
from .http1 import json_answer, with_close

RECEIVE_SIZE = 65536
PENDING_LIMIT = 65536
# After an error answer the client may still be sending (a body over the
# limit, say). Closing with its bytes unread makes the kernel reset the
# connection, which can destroy the answer before the client reads it (RFC
# 9112 section 9.6). So the proxy half-closes and discards what still comes,
# for a bounded time: nginx's "lingering close".
LINGER_TIMEOUT = 5.0  # in all
LINGER_IDLE_TIMEOUT = 1.0  # without a byte from the client
# Where a head ends, found the way h11 finds it, so that the screened bytes
# are exactly the bytes h11 then parses as the head.
_HEAD_END = re.compile(rb"\n\r?\n")

logger = logging.getLogger("trio_failover")


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


Handler = Callable[["ClientConnection", ClientRequest], Awaitable[bool]]


class ClientConnection:
    """One client connection: its reader, h11 server state, keep-alive and deadlines.

    ``serve(handler)`` runs the whole connection: it waits for each request
    (within ``client_header_timeout`` for the first, ``keepalive_timeout``
    between requests), reads it, and hands it to ``handler``, which answers
    and says whether the connection may carry another.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_head: int,
        max_body: int,
        client_header_timeout: float,
        keepalive_timeout: float = math.inf,
        drain: Drain | None = None,
    ) -> None:
        self.stream = stream
        # Read before each answer: once the server drains, the answer says
        # "Connection: close", so that a keep-alive client does not send a
        # next request into a connection about to close.
        self._drain = drain or Drain()
        self._keepalive_timeout = keepalive_timeout
        self._max_head = max_head
        self.conn = self._new_h11()
        self._max_body = max_body
        self._header_timeout = client_header_timeout
        # The first head is due one header timeout after the connection
        # opened (as with nginx's client_header_timeout), not after its
        # first byte: a client may not spend the timeout twice.
        self._opened = trio.current_time()
        self._pending = bytearray()
        # The reader may hold a whole head, and one byte more to tell that it
        # is too large, before h11 gets any of it.
        self._pending_limit = max(PENDING_LIMIT, max_head + 1)
        self._head_screened = False
        self._head_searched = 0  # pending bytes already searched for the head's end
        self._eof_fed = False
        self._answering_head = False
        self.closed: Closed | None = None
        self._closed_event = trio.Event()
        self._arrived = trio.Event()
        self._room = trio.Event()
        self.requests_read = 0

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self._max_head)

    # -- the connection's life -----------------------------------------------

    async def serve(self, handler: Handler) -> None:
        """Serve requests with ``handler`` until the connection ends; closes the stream."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.run_reader)
                await self._serve_requests(handler)
                nursery.cancel_scope.cancel()
        finally:
            await self.aclose()

    async def _serve_requests(self, handler: Handler) -> None:
        while self.prepare_next():
            if not await self._wait_for_request():
                return
            try:
                request = await self.read_request()
            except ClientError as exc:
                logger.info(
                    "bad request", extra={"fields": {"status": exc.status, "error": str(exc)}}
                )
                await self.send_client_error(exc)
                return
            if request is None:
                return
            if not await handler(self, request):
                return

    async def _wait_for_request(self) -> bool:
        """Wait (idle) for the first byte of a next request; False: give up."""
        if self.has_buffered():
            return True
        timeout = self._header_timeout if self.requests_read == 0 else self._keepalive_timeout
        with self._drain.idle(timeout):
            await self.wait_input()
        return self.has_buffered() and not (self._drain.active and self.closed is not None)

    # -- the reader task -----------------------------------------------------

    async def run_reader(self) -> None:
        """Receive client bytes until EOF or error; run in the connection's nursery."""
        try:
            while True:
                while len(self._pending) >= self._pending_limit:
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

    def _feed(self) -> bool:
        """Move pending bytes into h11 (and EOF once everything is in).

        A head is held back until it is complete and screened. Returns False
        when h11 got nothing new.

        Raises:
            ClientError: the head is malformed (400) or too large (431).
        """
        if not self._head_screened:
            match = _HEAD_END.search(self._pending, max(0, self._head_searched - 2))
            if match is None:
                self._head_searched = len(self._pending)
                if len(self._pending) > self._max_head:
                    raise ClientError(431, "request header fields too large", "headers_too_large")
                if self.closed is None:
                    return False
                # Cut short by the client: h11 tells what the bytes amount to.
            else:
                screen_head(bytes(self._pending[: match.end()]), self._max_head)
            self._head_screened = True
        if self._pending:
            self.conn.receive_data(bytes(self._pending))
            self._pending.clear()
            self._room.set()
            return True
        if self.closed is not None and not self._eof_fed:
            self.conn.receive_data(b"")
            self._eof_fed = True
            return True
        return False

    def _poll_event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        """The next event from what has arrived so far; ``NEED_DATA``: wait for more."""
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            if self.conn.their_state is h11.CLOSED:
                return h11.ConnectionClosed()
            if not self._feed():
                if self._eof_fed:
                    return h11.ConnectionClosed()
                return h11.NEED_DATA

    async def _next_event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        while True:
            event = self._poll_event()
            if event is not h11.NEED_DATA:
                return event
            await self._arrived.wait()

    # -- reading requests ----------------------------------------------------

    def prepare_next(self) -> bool:
        """Get h11 ready for the next request; False when none may follow."""
        conn = self.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            trailing = conn.trailing_data[0]
            if trailing:
                # Pipelined bytes: a fresh h11 connection (what
                # start_next_cycle() would give) without them, and the bytes
                # back in the pending buffer, so that the next head is
                # screened like the first.
                self._pending[:0] = trailing
                self.conn = conn = self._new_h11()
            else:  # the usual case: h11 holds nothing unscreened
                conn.start_next_cycle()
            self._head_screened = False
            self._head_searched = 0
            self._eof_fed = False
            self._answering_head = False
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
        started = self._opened if self.requests_read == 0 else trio.current_time()
        try:
            # A head that has arrived whole (the usual case) needs no deadline.
            event = self._poll_event()
            if event is h11.NEED_DATA:
                with trio.move_on_at(started + self._header_timeout) as head_scope:
                    event = await self._next_event()
                if head_scope.cancelled_caught:
                    message = "the request head did not arrive in time"
                    raise ClientError(408, message, "request_timeout")
        except h11.RemoteProtocolError as exc:
            raise _client_error(exc) from exc
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise ClientError(400, "malformed request", "bad_request")
        self._answering_head = event.method == b"HEAD"
        # h11's Headers is a Sequence read item by item in Python: listed
        # once, then read as a list.
        headers = list(event.headers)
        check_framing(headers, event.http_version)
        self.requests_read += 1
        body = await self._read_body(headers)
        return ClientRequest(
            method=event.method,
            target=event.target,
            headers=headers,
            body=body,
            http_version=event.http_version,
        )

    async def _read_body(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        for name, value in headers:
            if name == b"content-length" and int(value) > self._max_body:
                raise ClientError(413, "request body too large", "request_too_large")
        if self.conn.they_are_waiting_for_100_continue:
            await self.send(h11.InformationalResponse(status_code=100, headers=[]))
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                # What h11 already holds needs no wait (a small body usually
                # came with its head); only a wait gets the deadline.
                event = self._poll_event()
                if event is h11.NEED_DATA:
                    # Between body bytes the client gets one header timeout of silence.
                    with trio.move_on_after(self._header_timeout) as scope:
                        event = await self._next_event()
                    if scope.cancelled_caught:
                        raise ClientError(408, "the request body stalled", "request_timeout")
            except h11.RemoteProtocolError as exc:
                raise _client_error(exc) from exc
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
        """Send h11 events in one write (body data is left out in answer to HEAD).

        Raises:
            ClientGone: the client connection broke.
        """
        start = events[0]
        if isinstance(start, h11.Response):
            # Only the call that starts an answer can need rewriting; the
            # relay's per-chunk calls skip this.
            if self._answering_head:
                # h11 refuses body bytes after a HEAD (and then sends nothing
                # at all); an answer the proxy makes itself keeps its head only.
                events = tuple(event for event in events if not isinstance(event, h11.Data))
            if self._drain.active:
                events = (with_close(start), *events[1:])
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
    ) -> int:
        """Send a complete JSON response; returns the body bytes sent (none after a HEAD)."""
        events = json_answer(status, document, headers, close=close)
        body = 0 if self._answering_head else len(events[1].data)
        await self.send(*events)
        return body

    async def send_client_error(self, error: ClientError) -> None:
        """Answer a bad request with its JSON error; the connection then closes."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        document = error_document("", error.status, error.code, str(error))
        try:
            await self.send_json(error.status, document, close=True)
        except (ClientGone, h11.LocalProtocolError):
            return
        await self._linger()

    async def _linger(self) -> None:
        """Half-close, then discard the client's bytes until it closes (bounded)."""
        with trio.move_on_after(LINGER_TIMEOUT):
            if isinstance(self.stream, trio.abc.HalfCloseableStream):
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.stream.send_eof()
            while self.closed is None:
                self._discard()
                with trio.move_on_after(LINGER_IDLE_TIMEOUT) as idle:
                    await self._arrived.wait()
                if idle.cancelled_caught:
                    break
        self._discard()

    def _discard(self) -> None:
        self._pending.clear()
        self._room.set()

    @property
    def reusable(self) -> bool:
        """Whether another request may follow on this connection."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    async def aclose(self) -> None:
        """Close the connection (abortive, never blocks)."""
        await trio.aclose_forcefully(self.stream)


def _client_error(exc: h11.RemoteProtocolError) -> ClientError:
    status = exc.error_status_hint
    if status == 431:
        return ClientError(431, "request header fields too large", "headers_too_large")
    # h11's message may quote the offending header line, and with it a
    # credential: neither the log line nor the 400 body repeats it.
    return ClientError(400, "malformed request", "bad_request")
