"""The wait for a committing response's first body bytes (docs/failover.md).

After the head of an answer that commits, ``upstream.py`` waits here for
the first body bytes: under ``first_body_timeout`` when the operator set
one, else unbounded; in an event stream, up to its first line that is not
a comment or blank, the pings before it held and given back with it.
"""

from __future__ import annotations

import h11
import trio

from ..core import errors
from ..core.config import Config
from ..core.sse import SseScanner
from .http1 import EarlyClose, read_body
from .upstream_errors import IO_ERRORS, map_error, mapped

# Comment and blank lines of an event stream held before its first event
# (they are not a first body byte). Pings are a few bytes every few seconds;
# a node that sends this much and no event is not pinging, and holding more
# would be unbounded.
HELD_LIMIT = 65536


async def first_body(
    name: str, stream: trio.abc.Stream, conn: h11.Connection, config: Config
) -> tuple[bytes, bool]:
    """The first body bytes of a committing response.

    Unbounded unless the operator opted in (``first_body_timeout``), because
    a node may send its head at once and then prefill for minutes.
    """
    if not config.first_body_timeout:
        # ``mapped`` spelled out: the default path of every request, where a
        # generator-based context manager costs more than the read it wraps.
        try:
            return await read_body(stream, conn)
        except (EarlyClose, *IO_ERRORS) as exc:
            raise map_error(name, "first body byte", exc) from exc
    with trio.move_on_after(config.first_body_timeout), mapped(name, "first body byte"):
        return await read_body(stream, conn)
    # Only the deadline gets here.
    raise errors.FirstBodyTimeout(
        name, "first body byte", f"no body byte {config.first_body_timeout}s after head"
    )


async def first_event(
    name: str, stream: trio.abc.Stream, conn: h11.Connection, config: Config, scanner: SseScanner
) -> tuple[bytes, bool]:
    """The first body bytes of an event stream, up to its first event line.

    Comment and blank lines (an engine's ``: ping`` during a long prefill)
    are held, not counted as the first body byte: the deadline runs on. The
    held bytes come back in front of the read with the first other line,
    unchanged. A body that ends or breaks with only such lines ended before
    its first byte (``UpstreamClosedEarly`` or the break's own error: next
    candidate, no cooldown). An empty body with a valid end commits, as any.
    """
    held: list[bytes] = []
    size = 0
    timeout = config.first_body_timeout
    with trio.move_on_after(timeout), mapped(name, "first body byte"):
        while True:
            chunk, complete = await read_body(stream, conn)
            if scanner.first_event_line(chunk) is not None:
                return b"".join([*held, chunk]) if held else chunk, complete
            if complete and not held and not chunk:
                return b"", True
            if complete:
                raise EarlyClose("the event stream ended with comments only")
            held.append(chunk)
            size += len(chunk)
            if size > HELD_LIMIT:
                raise errors.UpstreamProtocolError(
                    name, "first body byte", f"over {HELD_LIMIT} bytes of comments, no event"
                )
    raise errors.FirstBodyTimeout(
        name, "first body byte", f"no body byte {timeout}s after head (comments only)"
    )
