"""Pure: what a proxy must refuse in a request (or an answer) that h11 would let through.

Request smuggling lives on two parsers disagreeing (RFC 9112 sections 2.2,
5.2, 6.1 and 7.1), so the client side screens each raw head before h11
parses it (``screen_head``), each parsed request's body framing
(``check_framing``) and, for a chunked body, its raw bytes as they arrive,
before h11 reads them (``ChunkScreen``). A node's parsed answer head is
screened for the control bytes h11 lets through (``answer_flaw``).

No message here quotes the peer's bytes: a refused line may hold a
credential, or (on a node connection) another client's answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import ClientError

# Control bytes other than HTAB (RFC 9110 section 5.5: a field value is
# VCHAR, obs-text, SP and HTAB). h11 refuses NUL, CR, LF and the other
# whitespace bytes in a field, not the rest (\x01, ESC, DEL...). In a raw
# head CR and LF are the line ends, which ``screen_head`` checks apart.
_CTL_IN_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_CTL_IN_FIELD = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def screen_head(head: bytes, max_head: int) -> None:
    """Refuse a complete raw head that h11 would accept but a proxy must not.

    Raises:
        ClientError: 431 over ``max_head`` bytes (h11 measures only heads
            still incomplete, so one that crosses the limit and ends in the
            same read would pass); 400 for a bare CR or LF (RFC 9112 section
            2.2 lets a recipient take a lone LF as a line end, the classic way
            to smuggle a header past a stricter parser), an obs-fold
            (section 5.2: reject it, or unfold it as h11 does silently) or a
            control byte other than HTAB (h11 relays ``\\x01`` or ``\\x7f``
            in a value as it came).
    """
    if len(head) > max_head:
        raise ClientError(431, "request header fields too large", "headers_too_large")
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        raise ClientError(400, "malformed request: bare CR or LF in the head", "bad_request")
    if b"\r\n " in head or b"\r\n\t" in head:
        raise ClientError(400, "malformed request: obsolete line folding", "bad_request")
    if _CTL_IN_HEAD.search(head) is not None:
        raise ClientError(400, "malformed request: control character in the head", "bad_request")


def check_framing(headers: list[tuple[bytes, bytes]], http_version: bytes) -> bool:
    """Refuse a request whose body framing two parsers could read differently.

    RFC 9112 section 6.1: ``Transfer-Encoding`` with ``Content-Length``, or
    in an HTTP/1.0 request, is faulty framing; h11 goes by the
    ``Transfer-Encoding``, a node or another hop may not.

    Returns:
        Whether the body is chunked (h11 refuses any other transfer coding).

    Raises:
        ClientError: 400.
    """
    names = {name for name, _ in headers}
    if b"transfer-encoding" not in names:
        return False
    if b"content-length" in names:
        message = "malformed request: both Transfer-Encoding and Content-Length"
        raise ClientError(400, message, "bad_request")
    if http_version == b"1.0":
        message = "malformed request: Transfer-Encoding in an HTTP/1.0 request"
        raise ClientError(400, message, "bad_request")
    return True


def underscored(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """The header names that hold an ``_`` (the caller drops them on the way to a node).

    A node that maps ``_`` to ``-``, as CGI does, would read
    ``Transfer_Encoding`` as framing that the proxy never saw: nginx drops
    such names by default (``underscores_in_headers off``).
    """
    return [name for name, _ in headers if b"_" in name]


def answer_flaw(reason: bytes, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """What is wrong with a node's parsed answer head that h11 accepted, or None.

    A control byte other than HTAB in the reason phrase or a field value
    (RFC 9112 section 4, RFC 9110 section 5.5) would reach the client byte
    for byte; the answer is a protocol error instead (fail over before
    commit). The words name the part, never its bytes.
    """
    search = _CTL_IN_FIELD.search
    if reason and search(reason) is not None:
        return "control character in the reason phrase"
    for _, value in headers:
        if search(value) is not None:
            return "control character in a header value"
    return None


# -- the chunked body (RFC 9112 section 7.1) --------------------------------------------------

# What the screen is reading; one state per place a byte is judged.
_SIZE, _SIZE_LF, _EXT, _DATA, _DATA_CR, _DATA_LF = range(6)
_TRAILER, _FIELD, _FIELD_LF, _END_LF = range(6, 10)
_HEX = {byte: int(chr(byte), 16) for byte in b"0123456789abcdefABCDEF"}
_MAX_DIGITS = 20  # hex digits, h11's bound too: no body is that long


def _bad(what: str) -> ClientError:
    return ClientError(400, f"malformed request body: {what}", "bad_request")


class ChunkScreen:
    """Screens a chunked request body as raw bytes, one read at a time, before h11.

    h11 reads a chunk line up to its CRLF and trailers up to a blank line
    ending in a bare LF, keeps trailing spaces after a size, lets any byte
    but LF into an extension, and does not count extensions against any
    limit. A hop that reads chunks strictly would then end the body
    elsewhere (``0\\r\\nX-T: y\\n\\n`` ends it for h11, not for a hop that
    waits for CRLF CRLF: the bytes after are a smuggled request). The
    screen holds the grammar of section 7.1 with the head's rules: every
    line ends in CRLF; no bare CR or LF; nothing between a size and its
    CRLF or ``;``; no control byte but HTAB in an extension or a trailer
    line; no obs-fold in trailers. Data bytes are skipped by count, lines
    searched with one regex, so the cost is linear in the body and each
    byte is looked at once, whatever the reads.

    ``counted`` is the chunk data (by the declared sizes), extension and
    trailer bytes so far: more than ``max_body`` is a 413, as for data.
    """

    __slots__ = ("_digits", "_left", "_limit", "_size", "_state", "counted", "done")

    def __init__(self, max_body: int) -> None:
        self._limit = max_body
        self._state = _SIZE
        self._size = 0
        self._digits = 0
        self._left = 0
        self.counted = 0
        self.done = False

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """Screen the next bytes of the connection; how many of them belong to the body.

        All of ``data`` until the body ends; then the index just after its
        last CRLF (the rest is the next request's, for the head screen), and
        ``done`` is True. After that, nothing more is screened.

        Raises:
            ClientError: 400 for a malformed chunk line, extension, trailer
                or chunk end; 413 when ``counted`` goes over ``max_body``.
        """
        if self.done:
            return 0
        size = len(data)
        pos = 0
        state = self._state
        try:
            while pos < size:
                if state == _DATA:
                    step = min(self._left, size - pos)
                    self._left -= step
                    pos += step
                    if not self._left:
                        state = _DATA_CR
                elif state in (_EXT, _FIELD):
                    found = _CTL_IN_FIELD.search(data, pos)
                    end = size if found is None else found.start()
                    self._count(end - pos)
                    if found is None:
                        pos = size
                    elif data[end] != 0x0D:
                        where = "extension" if state == _EXT else "trailer"
                        raise _bad(f"bare LF or control character in a chunk {where}")
                    else:
                        state = _SIZE_LF if state == _EXT else _FIELD_LF
                        pos = end + 1
                else:
                    state = self._step(state, data[pos])
                    pos += 1
                    if state < 0:
                        self.done = True
                        return pos
        finally:
            self._state = state
        return size

    def _step(self, state: int, byte: int) -> int:
        """The state after one byte judged on its own (a size digit, a line end...)."""
        if state == _SIZE:
            digit = _HEX.get(byte)
            if digit is not None and self._digits < _MAX_DIGITS:
                self._size = self._size * 16 + digit
                self._digits += 1
                return _SIZE
            if self._digits and byte == 0x0D:
                return _SIZE_LF
            if self._digits and byte == 0x3B:  # ";": an extension
                return _EXT
            # Trailing spaces too: h11 takes "3  \r\n", RFC 9112 7.1 does not.
            raise _bad("invalid chunk size line")
        if state == _SIZE_LF:
            if byte != 0x0A:
                raise _bad("bare CR")
            self._count(self._size)
            self._left = self._size
            return _DATA if self._size else _TRAILER  # size 0: the last chunk
        if state in (_DATA_CR, _DATA_LF):
            if byte != (0x0D if state == _DATA_CR else 0x0A):
                raise _bad("chunk data not ended by CRLF")
            if state == _DATA_CR:
                return _DATA_LF
            self._size = self._digits = 0
            return _SIZE
        if state == _TRAILER:
            if byte == 0x0D:
                return _END_LF
            if byte in (0x20, 0x09):
                raise _bad("obsolete line folding")
            if byte == 0x0A:
                raise _bad("bare LF")  # "0\r\n\n" and "...\n\n": h11's blank line
            if byte < 0x20 or byte == 0x7F:
                raise _bad("control character in a chunk trailer")
            self._count(1)
            return _FIELD
        # _FIELD_LF or _END_LF: the LF of a CRLF.
        if byte != 0x0A:
            raise _bad("bare CR")
        return _TRAILER if state == _FIELD_LF else -1

    def _count(self, size: int) -> None:
        self.counted += size
        if self.counted > self._limit:
            raise ClientError(413, "request body too large", "request_too_large")
