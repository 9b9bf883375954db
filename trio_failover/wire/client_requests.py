"""Reading the client's requests: h11 server state, the screen, limits and deadlines.

Each request head is screened as raw bytes before h11 parses it, for what
h11 lets through but a proxy must not (RFC 9112 sections 2.2, 5.2 and 6.1;
request smuggling lives on two parsers disagreeing): an obs-fold, a bare CR
or LF, a head over the size limit even when it arrived whole. Each request
cycle gets a fresh h11 connection so that every head, also a pipelined one,
passes the screen: the bytes the previous connection received beyond its
message go back to the reader's pending buffer.

A chunked body is screened as raw bytes too (``core.screen.ChunkScreen``),
for the same reason: h11 takes a bare LF as the end of its trailers. The
bytes that came with the head are screened as soon as the head says
"chunked", before h11 reads a byte of the body; every later read is
screened before it goes to h11. Header names with an ``_`` are dropped here, on their way to
a node (nginx's ``underscores_in_headers off``).
"""

from __future__ import annotations

import logging
import re

import attrs
import h11
import trio

from ..core.errors import ClientError
from ..core.requests import request_line_path
from ..core.screen import ChunkScreen, check_framing, screen_head, underscored
from .client_reader import ClientReader

__all__ = ["ClientRequest", "RequestReader"]

logger = logging.getLogger("trio_failover")

# Where a head ends, found the way h11 finds it, so that the screened bytes
# are exactly the bytes h11 then parses as the head.
_HEAD_END = re.compile(rb"\n\r?\n")

Polled = h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]
Headers = list[tuple[bytes, bytes]]


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
