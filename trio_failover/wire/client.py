"""The client side of one connection, its whole life.

``ClientConnection.serve`` runs the request loop with its keep-alive waits
on parts that each do one job:

- ``ClientReader``: the one task that reads the client and doubles as the
  close watcher (FIN or RST, seen at any moment);
- ``RequestReader``: h11 server state, the head screen, reading one
  request under its size limits and deadlines;
- ``ResponseWriter``: writing answers, error answers and the lingering
  close;
- ``Drain``: the server's drain, as the connections see it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterator

import attrs
import h11
import trio

from ..core.answers import error_document
from ..core.errors import ClientError
from ..core.requests import request_line_path
from ..core.screen import ChunkScreen, check_framing, screen_head, underscored
from . import http1
from .http1 import RECEIVE_SIZE, json_answer, with_close

__all__ = [
    "PENDING_LIMIT",
    "Admit",
    "ClientConnection",
    "ClientGone",
    "ClientRequest",
    "Closed",
    "Drain",
    "Handler",
    "TakenOver",
]

logger = logging.getLogger("trio_failover")

PENDING_LIMIT = 65536

Polled = h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]
Headers = list[tuple[bytes, bytes]]


class Closed(enum.Enum):
    """How the client's side of the connection ended."""

    EOF = "eof"  # FIN: the client closed (or half-closed) its sending side
    RESET = "reset"  # RST or another socket error


class ClientGone(Exception):
    """The client connection broke while the proxy was writing to it."""


@attrs.frozen
class ClientRequest:
    """One complete request from the client, with its body buffered."""

    method: bytes
    target: bytes
    headers: Headers
    body: bytes
    http_version: bytes
    # Refused at its head by ``admit``: its body was read and thrown away
    # (``body`` is empty), so that the connection can carry the next request.
    refused: bool = False


Handler = Callable[["ClientConnection", ClientRequest], Awaitable[bool]]
# Whether a request, by its head, may have its body buffered (a key check).
Admit = Callable[[list[tuple[bytes, bytes]]], bool]


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
        admit: Admit | None = None,
        admin: bool = False,
    ) -> None:
        self.stream = stream
        self._admit = admit
        self._drain = drain or Drain()
        self._keepalive_timeout = keepalive_timeout
        self._header_timeout = client_header_timeout
        # The first head is due one header timeout after the connection
        # opened (as with nginx's client_header_timeout), not after its
        # first byte: a client may not spend the timeout twice.
        self._opened = trio.current_time()
        # The reader may hold a whole head, and one byte more to tell that it
        # is too large, before h11 gets any of it.
        self._reader = ClientReader(stream, max(PENDING_LIMIT, max_head + 1))
        self._requests = RequestReader(
            self._reader,
            max_head=max_head,
            max_body=max_body,
            header_timeout=client_header_timeout,
        )
        # ``admin``: the admin listener's connection, whose error answers
        # say so in their ``type`` (``core.answers``).
        self._writer = ResponseWriter(
            stream, self._requests, self._reader, self._drain, admin=admin
        )
        # The parts' methods under the connection's names, which the workload
        # and the tests call: bound once, not wrapped per call.
        self.run_reader = self._reader.run
        self.wait_closed = self._reader.wait_closed
        self.watch = self._reader.watch
        self.wait_input = self._reader.wait_input
        self.prepare_next = self._requests.prepare_next
        self.has_buffered = self._requests.has_buffered
        self.send = self._writer.send
        self.send_data = self._writer.send_data
        self.send_json = self._writer.send_json
        self.send_client_error = self._writer.send_client_error

    @property
    def closed(self) -> Closed | None:
        """How the client's side ended (None: it has not)."""
        return self._reader.closed

    @property
    def conn(self) -> h11.Connection:
        """The h11 connection of the request cycle in progress."""
        return self._requests.conn

    @property
    def requests_read(self) -> int:
        """How many request heads were read on this connection."""
        return self._requests.requests_read

    @property
    def reusable(self) -> bool:
        """Whether another request may follow on this connection."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    async def serve(self, handler: Handler) -> None:
        """Serve requests with ``handler`` until the connection ends; closes the stream."""
        try:
            async with trio.open_nursery() as nursery:
                self._reader.receive_ready()
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

    async def read_request(self) -> ClientRequest | None:
        """The next complete request, or None when the client closed between requests.

        The whole head must arrive within the header timeout; the body may
        pause at most one header timeout between its bytes.

        Raises:
            ClientError: 400 malformed, 408 too slow, 413 body too large,
                431 head too large.
        """
        started = self._opened if self.requests_read == 0 else trio.current_time()
        read = await self._requests.read_head(started)
        if read is None:
            return None
        head, headers = read
        # A request refused by its head (no valid key) never gets its body
        # buffered: a client without a key cannot make the proxy hold
        # --max-request-body bytes per connection. Nor is it invited to send
        # a body only to have it dropped (no 100 Continue).
        refused = self._admit is not None and not self._admit(headers)
        if not refused and self.conn.they_are_waiting_for_100_continue:
            await self.send(h11.InformationalResponse(status_code=100, headers=[]))
        body = await self._requests.read_body(keep=not refused)
        return ClientRequest(
            method=head.method,
            target=head.target,
            headers=headers,
            body=body,
            http_version=head.http_version,
            refused=refused,
        )

    def take_over(self, replay: bytes) -> TakenOver:
        """The connection from here on as a stream, for a protocol that takes it over.

        It returns ``replay`` (say, the upgrade request, which a WebSocket
        library wants to read itself), then the bytes h11 holds beyond the
        request, then the client's next bytes. The request loop must not
        read again: the handler that takes over ends the connection.
        """
        return TakenOver(replay + self.conn.trailing_data[0], self._reader, self.stream)

    async def aclose(self) -> None:
        """Close the connection (abortive, never blocks)."""
        await trio.aclose_forcefully(self.stream)


class Drain:
    """The server's drain: once begun, idle keep-alive waits end and answers close."""

    def __init__(self) -> None:
        self.active = False
        self._idle_scopes: set[trio.CancelScope] = set()

    def begin(self) -> None:
        """Stop taking new requests: idle keep-alive connections close now."""
        self.active = True
        for scope in list(self._idle_scopes):
            scope.cancel()

    @contextlib.contextmanager
    def idle(self, timeout: float) -> Iterator[trio.CancelScope]:
        """A wait of at most ``timeout`` that the drain cuts short (at once, if begun)."""
        with trio.move_on_after(timeout) as scope:
            # An idle connection holds up no drain: begin() cancels it.
            self._idle_scopes.add(scope)
            try:
                if self.active:
                    scope.cancel()
                yield scope
            finally:
                self._idle_scopes.discard(scope)


# The reader: one task per connection, also the close watcher.
#
# One reader task per connection receives from the client for the whole
# connection lifetime, so a FIN or an RST is seen at any moment, also while
# an upstream attempt is pending or a committed stream is silent. Received
# bytes are kept (never consumed by the watcher) until the request side
# takes them, so a pipelined next request survives. The reader stops
# receiving once its limit of bytes wait: it never reads without bound.
#
# A single long-lived reader also means ``receive_some`` is never cancelled
# in the middle of a request, which matters for TLS streams.


class ClientReader:
    """The client's bytes as they arrive, kept in ``pending``, and how its side ended.

    ``run`` is the task; everything else is called by the request loop, the
    workload's watcher and the lingering close.
    """

    def __init__(self, stream: trio.abc.Stream, limit: int) -> None:
        self._stream = stream
        self._limit = limit
        self.pending = bytearray()
        self.closed: Closed | None = None
        self._closed_event = trio.Event()
        self._arrived = trio.Event()
        self._room = trio.Event()
        self._watcher: trio.Event | None = None
        self._failed: trio.BrokenResourceError | None = None  # by ``receive_ready``

    def receive_ready(self) -> None:
        """Take the bytes the kernel already holds, without waiting; before ``run`` starts.

        Not a checkpoint. A new connection's request has nearly always
        arrived by the time its task runs; taken here, the request loop
        starts on it in the same step, where waiting for ``run`` would cost
        three passes of the scheduler (the reader task's start, its wait for
        readability, the wake-up), each of them milliseconds under load
        (issue 33). A plain socket stream only; an EOF is left for ``run``
        to meet (it is read again), an error is raised by ``run``.
        """
        try:
            data = http1.read_now(self._stream, RECEIVE_SIZE)
        except trio.BrokenResourceError as exc:
            self._failed = exc
            return
        if data:
            self.pending += data

    async def run(self) -> None:
        """Receive client bytes until EOF or error; run in the connection's nursery."""
        try:
            if self._failed is not None:
                raise self._failed
            while True:
                while len(self.pending) >= self._limit:
                    self._room = trio.Event()
                    await self._room.wait()
                data = await http1.receive(self._stream, RECEIVE_SIZE)
                if not data:
                    self.closed = Closed.EOF
                    return
                self.pending += data
                self._wake()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = Closed.RESET
        finally:
            self._closed_event.set()
            if self._watcher is not None:
                self._watcher.set()
            self._wake()

    def _wake(self) -> None:
        self._arrived.set()
        self._arrived = trio.Event()

    async def wait_closed(self) -> Closed:
        """Wait until the client's side ends; returns how (FIN or RST)."""
        await self._closed_event.wait()
        assert self.closed is not None
        return self.closed

    def watch(self, event: trio.Event | None) -> None:
        """Set ``event`` too when the client's side ends (None: no longer).

        One workload at a time watches a connection; its watcher waits on an
        event that the workload also sets when it is done, so that the
        watcher ends by returning instead of by a cancellation.
        """
        self._watcher = event

    async def wait_arrival(self) -> None:
        """Wait for the next bytes, or the end of the client's side."""
        await self._arrived.wait()

    async def wait_input(self) -> None:
        """Wait until bytes are pending or the client's side has ended."""
        while not self.pending and self.closed is None:
            await self._arrived.wait()

    def take(self) -> bytes:
        """All pending bytes, removed; the task may receive again."""
        data = bytes(self.pending)
        self.discard()
        return data

    def discard(self) -> None:
        """Drop the pending bytes (and let the task receive again)."""
        self.pending.clear()
        self._room.set()


class TakenOver(trio.abc.Stream):
    """The rest of a client connection, for a protocol that takes it over (a WebSocket).

    The reader task keeps receiving; this stream returns ``replay`` first
    (bytes already consumed, such as the upgrade request h11 parsed, which
    the new protocol wants to read itself), then what the reader holds and
    receives. Sending and closing go to the connection's stream.
    """

    def __init__(self, replay: bytes, reader: ClientReader, stream: trio.abc.Stream) -> None:
        self._ahead = replay
        self._reader = reader
        self._stream = stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """The next bytes; ``b""`` once the client sent its FIN.

        Raises:
            trio.BrokenResourceError: the client's side was reset.
        """
        reader = self._reader
        if self._ahead or reader.pending or reader.closed is not None:
            await trio.lowlevel.checkpoint()
        else:
            await reader.wait_input()
        if not self._ahead:
            if not reader.pending:
                if reader.closed is Closed.RESET:
                    raise trio.BrokenResourceError("the client connection was reset")
                return b""
            self._ahead = reader.take()
        size = len(self._ahead) if max_bytes is None else max_bytes
        data, self._ahead = self._ahead[:size], self._ahead[size:]
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send on the connection's stream."""
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        """As the connection's stream does."""
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Close the connection's stream."""
        await self._stream.aclose()


# Reading the requests: h11 server state, the screen, limits and deadlines.
#
# Each request head is screened as raw bytes before h11 parses it, for what
# h11 lets through but a proxy must not (RFC 9112 sections 2.2, 5.2 and 6.1;
# request smuggling lives on two parsers disagreeing): an obs-fold, a bare CR
# or LF, a head over the size limit even when it arrived whole. Each request
# cycle gets a fresh h11 connection so that every head, also a pipelined one,
# passes the screen: the bytes the previous connection received beyond its
# message go back to the reader's pending buffer.
#
# A chunked body is screened as raw bytes too (``core.screen.ChunkScreen``),
# for the same reason: h11 takes a bare LF as the end of its trailers. The
# bytes that came with the head are screened as soon as the head says
# "chunked", before h11 reads a byte of the body; every later read is
# screened before it goes to h11. Header names with an ``_`` are dropped
# here, on their way to a node (nginx's ``underscores_in_headers off``).

# Where a head ends, found the way h11 finds it, so that the screened bytes
# are exactly the bytes h11 then parses as the head.
_HEAD_END = re.compile(rb"\n\r?\n")


class _HeadScreen:
    """Holds a head back from h11 until it has arrived whole and passed the screen."""

    def __init__(self, max_head: int) -> None:
        self._max_head = max_head
        self.passed = False
        self._searched = 0  # pending bytes already searched for the head's end
        # The screened head, kept (no copy) for the path of an error answer.
        self.head: bytes | None = None

    def reset(self) -> None:
        """A next request: its head is screened anew."""
        self.passed = False
        self._searched = 0
        self.head = None

    def lets_through(self, pending: bytearray, closed: bool) -> bool:
        """Whether the pending bytes may go to h11 now.

        Raises:
            ClientError: the head is malformed (400) or too large (431).
        """
        if self.passed:
            return True
        match = _HEAD_END.search(pending, max(0, self._searched - 2))
        if match is None:
            self._searched = len(pending)
            if len(pending) > self._max_head:
                raise ClientError(431, "request header fields too large", "headers_too_large")
            if not closed:
                return False
            # Cut short by the client: h11 tells what the bytes amount to.
        else:
            self.head = bytes(pending[: match.end()])
            screen_head(self.head, self._max_head)
        self.passed = True
        return True


class RequestReader:
    """The h11 server connection, fed screened bytes from the reader, read under limits.

    ``conn`` is the current h11 connection (the response side writes with
    it too); ``answering_head`` says that the request in progress is a HEAD.
    """

    def __init__(
        self, reader: ClientReader, *, max_head: int, max_body: int, header_timeout: float
    ) -> None:
        self._reader = reader
        self._max_head = max_head
        self._max_body = max_body
        self._header_timeout = header_timeout
        self.conn = self._new_h11()
        self._screen = _HeadScreen(max_head)
        # The chunked body's screen, while a chunked request is read; the
        # bytes after the head that came in the head's read, until
        # ``read_head`` knows the framing.
        self._chunks: ChunkScreen | None = None
        self._after_head: memoryview | None = None
        self._eof_fed = False
        self.answering_head = False
        self.requests_read = 0

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self._max_head)

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
                self._reader.pending[:0] = trailing
                self.conn = conn = self._new_h11()
            else:  # the usual case: h11 holds nothing unscreened
                conn.start_next_cycle()
            self._screen.reset()
            self._chunks = self._after_head = None
            self._eof_fed = False
            self.answering_head = False
        return conn.our_state is h11.IDLE and conn.their_state is h11.IDLE

    def error_path(self) -> str:
        """The path for the shape of an error answer to this request ("" if unknown).

        Read from the raw head's request line (the whole head once screened,
        else as far as it came), so that a head refused before h11 parsed it
        (a bad header, too large, too slow) still names its path when that
        line is well-formed (Ollama's shape under ``/api/``).
        """
        head = self._screen.head
        return request_line_path(self._reader.pending if head is None else head)

    def has_buffered(self) -> bool:
        """Whether request bytes (or the client's close) wait to be read."""
        reader = self._reader
        return bool(reader.pending) or bool(self.conn.trailing_data[0]) or reader.closed is not None

    def _feed(self) -> bool:
        """Move pending bytes into h11 (and EOF once everything is in).

        A head is held back until it is complete and screened. Returns False
        when h11 got nothing new.

        Raises:
            ClientError: the head is malformed (400) or too large (431).
        """
        pending, closed = self._reader.pending, self._reader.closed
        screen = self._screen
        screened = screen.passed
        if not screen.lets_through(pending, closed is not None):
            return False
        if pending:
            chunks = self._chunks
            if chunks is not None:  # a chunked body: screened before h11 reads it
                chunks.feed(pending)
            data = self._reader.take()
            head = screen.head
            if not screened and head is not None and len(data) > len(head):
                # The head passed with this read: its framing is not known
                # yet, the bytes after it wait for ``read_head`` (no copy).
                self._after_head = memoryview(data)[len(head) :]
            self.conn.receive_data(data)
            return True
        if closed is not None and not self._eof_fed:
            self.conn.receive_data(b"")
            self._eof_fed = True
            return True
        return False

    def _poll_event(self) -> Polled:
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

    async def _next_event(self) -> Polled:
        while True:
            event = self._poll_event()
            if event is not h11.NEED_DATA:
                return event
            await self._reader.wait_arrival()

    async def _event_by(self, deadline: float | None, late: str) -> Polled:
        """The next event; a wait for it ends at ``deadline`` (None: one header
        timeout from now) with a 408 that says ``late``; h11's refusals as 400 or 431.
        """
        try:
            # What h11 already holds needs no wait (a head or a small body
            # that arrived whole, the usual case); only a wait gets the deadline.
            event = self._poll_event()
            if event is h11.NEED_DATA:
                if deadline is None:
                    deadline = trio.current_time() + self._header_timeout
                with trio.move_on_at(deadline) as scope:
                    event = await self._next_event()
                if scope.cancelled_caught:
                    raise ClientError(408, late, "request_timeout")
        except h11.RemoteProtocolError as exc:
            raise _client_error(exc) from exc
        return event

    async def read_head(self, started: float) -> tuple[h11.Request, Headers] | None:
        """The next request's head and its headers, due one header timeout after ``started``.

        Returns None when the client closed between requests.

        Raises:
            ClientError: 400 malformed or conflicting framing, 408 too slow,
                413 declared body too large, 431 head too large.
        """
        deadline = started + self._header_timeout
        event = await self._event_by(deadline, "the request head did not arrive in time")
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise ClientError(400, "malformed request", "bad_request")
        self.answering_head = event.method == b"HEAD"
        # h11's Headers is a Sequence read item by item in Python: listed
        # once, then read as a list.
        headers = list(event.headers)
        self._after_head, after_head = None, self._after_head
        if check_framing(headers, event.http_version):
            chunks = self._chunks = ChunkScreen(self._max_body)
            if after_head is not None:
                chunks.feed(after_head)
        if b"_" in (self._screen.head or b"") and underscored(headers):
            headers = _without_underscores(headers)
        self.requests_read += 1
        for name, value in headers:
            if name == b"content-length" and int(value) > self._max_body:
                raise ClientError(413, "request body too large", "request_too_large")
        return event, headers

    async def read_body(self, *, keep: bool = True) -> bytes:
        """The request's whole body; the client may pause one header timeout between bytes.

        With ``keep=False`` the body is read to its end and dropped (``b""``).

        Raises:
            ClientError: 400 incomplete or malformed, 408 stalled, 413 too large.
        """
        parts: list[bytes] = []
        size = 0
        while True:
            # Between body bytes the client gets one header timeout of silence.
            event = await self._event_by(None, "the request body stalled")
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self._max_body:
                    raise ClientError(413, "request body too large", "request_too_large")
                if keep:
                    parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            else:
                raise ClientError(400, "request body incomplete", "bad_request")


def _without_underscores(headers: Headers) -> Headers:
    """``headers`` without the names that hold an ``_``, each drop logged at debug."""
    for name in underscored(headers):
        fields = {"header": name.decode("latin-1")}
        logger.debug("request header with an underscore dropped", extra={"fields": fields})
    return [(name, value) for name, value in headers if b"_" not in name]


def _client_error(exc: h11.RemoteProtocolError) -> ClientError:
    status = exc.error_status_hint
    if status == 431:
        return ClientError(431, "request header fields too large", "headers_too_large")
    # h11's message may quote the offending header line, and with it a
    # credential: neither the log line nor the 400 body repeats it.
    return ClientError(400, "malformed request", "bad_request")


# Writing to the client: answers in one write each, error answers, the
# lingering close.

# After an error answer the client may still be sending (a body over the
# limit, say). Closing with its bytes unread makes the kernel reset the
# connection, which can destroy the answer before the client reads it (RFC
# 9112 section 9.6). So the proxy half-closes and discards what still comes,
# for a bounded time: nginx's "lingering close".
LINGER_TIMEOUT = 5.0  # in all
LINGER_IDLE_TIMEOUT = 1.0  # without a byte from the client


class ResponseWriter:
    """Sends h11 events on the request side's current h11 connection.

    ``drain`` is read before each answer: once the server drains, the
    answer says "Connection: close", so that a keep-alive client does not
    send a next request into a connection about to close.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        requests: RequestReader,
        reader: ClientReader,
        drain: Drain,
        *,
        admin: bool = False,
    ) -> None:
        self._stream = stream
        self._admin = admin
        self._requests = requests
        self._reader = reader
        self._drain = drain

    async def send(self, *events: h11.Event) -> None:
        """Send h11 events in one write (body data is left out in answer to HEAD).

        Raises:
            ClientGone: the client connection broke.
        """
        conn = self._requests.conn
        start = events[0]
        if isinstance(start, h11.Response):
            # Only the call that starts an answer can need rewriting; the
            # relay's per-chunk calls skip this.
            if self._requests.answering_head:
                # h11 refuses body bytes after a HEAD (and then sends nothing
                # at all); an answer the proxy makes itself keeps its head only.
                events = tuple(event for event in events if not isinstance(event, h11.Data))
            if self._drain.active:
                events = (with_close(start), *events[1:])
        data = b"".join(conn.send(event) or b"" for event in events)
        try:
            await http1.send(self._stream, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            conn.send_failed()
            raise ClientGone(str(exc)) from exc

    async def send_data(self, data: bytes) -> None:
        """Send body bytes of a committed answer in one write: the relay's per-chunk call.

        ``send(h11.Data(data=data))`` without its tuple, its search for a head
        and its join: the hot path of a stream.

        Raises:
            ClientGone: the client connection broke.
        """
        conn = self._requests.conn
        out = conn.send(h11.Data(data=data))
        assert out is not None  # only ConnectionClosed sends nothing
        try:
            await http1.send(self._stream, out)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            conn.send_failed()
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
        body = 0 if self._requests.answering_head else len(events[1].data)
        await self.send(*events)
        return body

    async def send_client_error(self, error: ClientError) -> None:
        """Answer a bad request with its JSON error; the connection then closes.

        Ollama's shape when the request line is well-formed and names a path
        under ``/api/``; otherwise, also when that line is malformed, OpenAI's.
        """
        if self._requests.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        path = self._requests.error_path()
        document = error_document(path, error.status, error.code, str(error), admin=self._admin)
        try:
            await self.send_json(error.status, document, close=True)
        except (ClientGone, h11.LocalProtocolError):
            return
        await self._linger()

    async def _linger(self) -> None:
        """Half-close, then discard the client's bytes until it closes (bounded)."""
        reader = self._reader
        with trio.move_on_after(LINGER_TIMEOUT):
            if isinstance(self._stream, trio.abc.HalfCloseableStream):
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._stream.send_eof()
            while reader.closed is None:
                reader.discard()
                with trio.move_on_after(LINGER_IDLE_TIMEOUT) as idle:
                    await reader.wait_arrival()
                if idle.cancelled_caught:
                    break
        reader.discard()
