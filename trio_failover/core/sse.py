"""Pure: which bytes of a ``text/event-stream`` body are progress (docs/failover.md).

An engine that reads a long prompt keeps its connection alive with SSE
comment lines (``: ping``) and blank lines. Neither is an answer: before
commit they must not satisfy the first-body deadline, after commit they must
not restart the stream-idle timer. A line is *progress* when its first byte
is neither ``:`` nor a line end.

Only line starts are looked at, never events or JSON. A byte begins a line
when it is the first byte of the body or follows a CR or an LF, so the one
piece of state carried from one read to the next is whether the last byte
read was a line end. A CRLF needs no pairing: the LF of a CRLF, read as the
start of an empty line, is a blank line, and a blank line is no progress
either way; the byte after the LF begins a line in both readings.

Use one ``SseScanner`` per response and feed it every body chunk, in order,
from the first (before and after commit), so that line starts are told apart
across reads::

    scanner = SseScanner()
    # before commit, with first-body-timeout on:
    if scanner.first_event_line(chunk) is None:
        held.append(chunk)          # only comments/blank lines so far
    else:
        commit; send b"".join(held) + chunk
    # after commit:
    relay(chunk)
    if scanner.progress(chunk):
        restart the stream-idle timer

A response that ends (or breaks) while every chunk so far gave None ended
before its first body byte: the held bytes are dropped with the attempt.
With first-body-timeout off the shell commits on the first byte as before,
but still feeds the scanner from that byte on: the stream-idle timer starts
only with the first chunk of progress.
"""

from __future__ import annotations

_NOT_PROGRESS = frozenset(b":\r\n")
_LINE_ENDS = frozenset(b"\r\n")


class SseScanner:
    """Finds line starts of progress in an SSE body, one read at a time."""

    __slots__ = ("_at_line_start",)

    def __init__(self) -> None:
        # The first byte of the body begins a line.
        self._at_line_start = True

    def first_event_line(self, chunk: bytes) -> int | None:
        """The index of the first byte of ``chunk`` that begins a line of progress.

        Args:
            chunk: the next bytes of the body, as read (empty is allowed and
                changes nothing).

        Returns:
            The index, or None when every line that begins in ``chunk`` is
            a comment or blank (the rest of a line begun in an earlier read
            keeps that line's kind).
        """
        if not chunk:
            return None
        at_line_start = self._at_line_start
        self._at_line_start = chunk[-1] in _LINE_ENDS
        if at_line_start and chunk[0] not in _NOT_PROGRESS:
            return 0  # the common case after commit: a read begins with "data:"
        return _after_line_end(chunk)

    def progress(self, chunk: bytes) -> bool:
        """Whether ``chunk`` begins any line that is neither a comment nor blank."""
        return self.first_event_line(chunk) is not None

    def __repr__(self) -> str:
        return f"SseScanner(at_line_start={self._at_line_start})"


def is_event_stream(content_type: bytes | None) -> bool:
    """Whether a ``Content-Type`` value is ``text/event-stream`` (any case, any parameters)."""
    if content_type is None:
        return False
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"text/event-stream"


def _after_line_end(chunk: bytes) -> int | None:
    """The first index after a CR or LF of ``chunk`` that begins a line of progress."""
    # bytes.find runs at memory speed; a regex over a long data line costs
    # hundreds of times more. Each find resumes where it last stopped, so a
    # chunk is scanned about twice in all, whatever its lines.
    size = len(chunk)
    lf = chunk.find(b"\n")
    cr = chunk.find(b"\r")
    while lf >= 0 or cr >= 0:
        end = cr if lf < 0 or 0 <= cr < lf else lf
        start = end + 1
        if start == size:
            return None
        if chunk[start] not in _NOT_PROGRESS:
            return start
        # A comment or a line end begins at ``start``: on to its end.
        if end == lf:
            lf = chunk.find(b"\n", start)
        else:
            cr = chunk.find(b"\r", start)
    return None
