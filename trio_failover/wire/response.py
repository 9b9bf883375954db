"""A response of one attempt, ready to commit: its head, first bytes and the rest.

``upstream.open_response`` makes it; the relay (``proxy/relay.py``) reads
the rest of the body from it and either gives its connection back to the
pool or closes it.
"""

from __future__ import annotations

import attrs
import h11
import trio

from ..core.config import Upstream
from ..core.headers import Headers
from ..core.sse import SseScanner
from .http1 import EarlyClose, read_chunk
from .pool import ConnectionPool
from .upstream_errors import IO_ERRORS as _IO_ERRORS
from .upstream_errors import map_error as _map_error

__all__ = ["Timings", "UpstreamResponse"]


@attrs.frozen
class Timings:
    """Trio-clock times of one attempt's milestones."""

    started: float
    written: float
    head: float
    first_body: float


class UpstreamResponse:
    """A committed-ready response: its whole head and its first body bytes.

    The rest of the body comes from ``receive_chunk``. When the body was
    relayed to its end, ``release`` hands the connection back to the pool
    (if it may carry another request); otherwise ``aclose`` closes it. A
    response that was not read to its end is never pooled.

    An event stream carries its ``scanner`` (``core.sse``), already fed with
    ``first_chunk``, for the relay to go on with; ``progressed`` says whether
    a line other than a comment or a blank one has come (always True for
    other bodies). ``first_chunk`` then holds, in order, the comment lines
    held before the first event.

    ``checks``: the liveness checks the attempt waited on; set
    on the instance only when there were any.
    """

    checks = 0

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
        *,
        scanner: SseScanner | None = None,
        progressed: bool = True,
        headers: Headers | None = None,
    ) -> None:
        self.node = node
        self.status = response.status_code
        self.reason = response.reason
        # ``headers``: the caller's list of ``response.headers``, if it made one.
        self.headers: Headers = list(response.headers) if headers is None else headers
        self.first_chunk = first_chunk
        self.complete = complete
        self.timings = timings
        self.scanner = scanner
        self.progressed = progressed
        self._stream = stream
        self._conn = conn
        self._pool = pool
        self._open = True
        self._starved = False  # h11 said NEED_DATA after the last bytes read

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
            data, self.complete, self._starved = await read_chunk(
                self._stream, self._conn, starved=self._starved
            )
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
        origins = self._pool.origins if self._pool is not None else None
        if origins is not None and origins.get(self.node.name, self.node) != self.node:
            await trio.aclose_forcefully(self._stream)  # a reload moved or removed the node
        elif self._pool is not None:  # it checks that the exchange ended cleanly
            await self._pool.release(self.node.name, self._stream, self._conn)
        else:
            await trio.aclose_forcefully(self._stream)

    async def aclose(self) -> None:
        """Close the connection to the node, forcefully (never blocks)."""
        if self._open:
            self._open = False
            await trio.aclose_forcefully(self._stream)
