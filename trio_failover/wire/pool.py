"""Keep-alive connections to nodes: per node, bounded, last in, first out.

A response read to its end leaves a connection that the next attempt at the
same node can use again, saving a TCP (and TLS) handshake on the critical
path of every request. The rules, which ``upstream.open_response`` and
``UpstreamResponse.release`` follow:

- Only a connection whose request and response both ended cleanly goes back
  (h11 in ``DONE``/``DONE``, no stray bytes, no ``Connection: close``). A
  cancelled, failed or abandoned attempt closes its connection instead.
- Checkout takes the most recently released connection (LIFO): it is the
  least likely to have been closed by the node, and the older ones are left
  to expire, so an idle fleet holds few sockets.
- A connection idle for ``idle_timeout`` or longer is never handed out. The
  default of 4 s stays below uvicorn's 5 s keep-alive (vLLM's server), so
  the node does not close a connection just as the proxy reuses it. Expiry
  is computed from ``now`` at checkout and release; there is no timer task,
  so an expired connection stays open (unused) until the next checkout or
  release for its node, or until ``aclose``.
- At most ``max_idle`` idle connections per node; a release beyond that
  closes the oldest one.
- ``max_idle == 0`` or ``idle_timeout == 0`` turns pooling off.

A pooled connection can still turn out dead when used (the node closed it
after the check); ``upstream.open_response`` then retries once on a fresh
connection, which is not a node failure.

The decisions (``take_idle``, ``put_idle``, ``is_reusable``) are plain
functions of the idle list and ``now``; ``ConnectionPool`` only closes what
they discard.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Sequence
from typing import Protocol, TypeVar

import attrs
import h11
import trio

__all__ = ["ConnectionPool", "IdleConnection", "is_reusable", "put_idle", "take_idle"]


class _Idle(Protocol):
    @property
    def idle_since(self) -> float: ...


IdleT = TypeVar("IdleT", bound=_Idle)


def _expired_prefix(idle: Sequence[_Idle], now: float, idle_timeout: float) -> int:
    # Released in time order, so the list is sorted by idle_since and the
    # expired entries are a prefix of it.
    count = 0
    for entry in idle:
        if now - entry.idle_since < idle_timeout:
            break
        count += 1
    return count


def take_idle(
    idle: list[IdleT], *, now: float, idle_timeout: float
) -> tuple[IdleT | None, list[IdleT]]:
    """Check out the newest usable connection of one node.

    Args:
        idle: the node's idle connections, oldest first; changed in place.
        now: the current Trio time.
        idle_timeout: seconds after which an idle connection is not reused.

    Returns:
        ``(connection or None, expired connections to close)``.
    """
    expired = _expired_prefix(idle, now, idle_timeout)
    discarded = idle[:expired]
    del idle[:expired]
    return (idle.pop() if idle else None), discarded


def put_idle(
    idle: list[IdleT], entry: IdleT, *, now: float, idle_timeout: float, max_idle: int
) -> list[IdleT]:
    """Return a connection to its node's idle list.

    Args:
        idle: the node's idle connections, oldest first; changed in place.
        entry: the connection coming back (its ``idle_since`` is ``now``).
        now: the current Trio time.
        idle_timeout: seconds after which an idle connection is not reused.
        max_idle: the most idle connections kept for one node.

    Returns:
        The connections to close: expired ones, the oldest beyond
        ``max_idle``, or ``entry`` itself when pooling is off.
    """
    if max_idle <= 0 or idle_timeout <= 0:
        return [entry]
    expired = _expired_prefix(idle, now, idle_timeout)
    excess = max(0, len(idle) - expired + 1 - max_idle)
    cut = expired + excess
    discarded = idle[:cut]
    del idle[:cut]
    idle.append(entry)
    return discarded


def is_reusable(conn: h11.Connection) -> bool:
    """Whether a client-side h11 connection may carry another request.

    Both messages must have ended cleanly (a ``Connection: close`` or an
    HTTP/1.0 answer leaves h11 in ``MUST_CLOSE``), and nothing may follow
    the response: extra bytes would be taken for the next answer.
    """
    data, closed = conn.trailing_data
    return conn.our_state is h11.DONE and conn.their_state is h11.DONE and not data and not closed


@attrs.define(slots=True)
class IdleConnection:
    """A connection to a node, with its h11 state, kept for the next request."""

    stream: trio.abc.Stream
    conn: h11.Connection
    idle_since: float


class ConnectionPool:
    """Idle keep-alive connections to nodes, by node name.

    Args:
        max_idle: the most idle connections per node (``0``: no pooling).
        idle_timeout: seconds after which an idle connection is not reused
            (``0``: no pooling).

    Cancellation: ``acquire`` and ``release`` never lose a connection; what
    they discard is closed with ``trio.aclose_forcefully`` even when the
    caller is being cancelled.
    """

    def __init__(self, *, max_idle: int, idle_timeout: float) -> None:
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self._idle: dict[str, list[IdleConnection]] = {}
        # A pool dropped without aclose() (an embedder that never calls it)
        # would leave its sockets to the garbage collector, which warns.
        weakref.finalize(self, _close_abandoned, self._idle)

    @property
    def enabled(self) -> bool:
        """Whether connections are kept at all."""
        return self.max_idle > 0 and self.idle_timeout > 0

    def idle_count(self, node: str) -> int:
        """How many idle connections ``node`` has (expired ones included)."""
        return len(self._idle.get(node, ()))

    async def acquire(self, node: str) -> IdleConnection | None:
        """The newest unexpired idle connection to ``node``, or None.

        The h11 state is ready for the next request.
        """
        idle = self._idle.get(node)
        if not idle:
            return None
        entry, expired = take_idle(idle, now=trio.current_time(), idle_timeout=self.idle_timeout)
        try:
            await _close_all(expired)
        except BaseException:
            if entry is not None:
                await trio.aclose_forcefully(entry.stream)
            raise
        return entry

    async def release(self, node: str, stream: trio.abc.Stream, conn: h11.Connection) -> None:
        """Keep a connection whose exchange ended cleanly, or close it.

        Args:
            node: the node's name.
            stream: the connection.
            conn: its client-side h11 state, after a complete response.
        """
        if not self.enabled or not is_reusable(conn):
            await trio.aclose_forcefully(stream)
            return
        conn.start_next_cycle()
        now = trio.current_time()
        entry = IdleConnection(stream, conn, now)
        discarded = put_idle(
            self._idle.setdefault(node, []),
            entry,
            now=now,
            idle_timeout=self.idle_timeout,
            max_idle=self.max_idle,
        )
        await _close_all(discarded)

    async def aclose(self) -> None:
        """Close every idle connection (at shutdown)."""
        entries = [entry for node in self._idle.values() for entry in node]
        self._idle.clear()
        await _close_all(entries)


async def _close_all(entries: list[IdleConnection]) -> None:
    for entry in entries:
        await trio.aclose_forcefully(entry.stream)


def _close_abandoned(idle: dict[str, list[IdleConnection]]) -> None:
    """Close the sockets of a pool that was dropped, outside any Trio run.

    Trio's own ``close`` needs a running Trio loop, which may be gone by
    now; an idle socket has no task waiting on it, so detaching its file
    descriptor and closing that is all there is to do.
    """
    for entries in idle.values():
        for entry in entries:
            transport = getattr(entry.stream, "transport_stream", entry.stream)  # TLS
            sock = getattr(transport, "socket", None)
            if isinstance(sock, trio.socket.SocketType):
                fd = sock.detach()
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
    idle.clear()
