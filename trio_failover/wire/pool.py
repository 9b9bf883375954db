"""Keep-alive connections to nodes: per node, bounded, last in, first out.

The rules (only a clean exchange is pooled, LIFO, at most ``max_idle`` per
node, expiry at ``idle_timeout``, a stale connection retried once, a
stream's connection kept a second until its node has kept one, a node that
closes after its answers learnt) are told
in docs/performance.md ("Keep-alive connections to nodes"), and the stray
bytes check at checkout in docs/reliability.md ("Stray bytes on pooled
connections"). What the code adds to them:

- ``watch`` is the pool's one watcher task (the proxy runs it for its
  lifetime; a pool is not used without it): it sleeps until the earliest
  idle deadline or until any idle socket turns readable, and closes what
  is due. An idle connection has no answer pending, so readable means the
  node closed it or sent bytes nobody asked for. The sockets are watched
  through one epoll set (Linux); a released connection joins it at the
  watcher's next look, within ``WATCH_DELAY``: one taken again before
  that, as on a busy keep-alive path, costs no ``epoll_ctl`` at all.
- Checkout looks at the connection (``unread``): one ``poll`` with a zero
  timeout on its socket, and for TLS the bytes the TLS object holds. The
  check runs once per reuse, never per chunk.

The decisions (``take_idle``, ``put_idle``, ``sweep_idle``, ``next_expiry``,
``is_reusable``) are plain functions of the idle lists and ``now``;
``ConnectionPool`` only closes what they discard.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import ssl
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

import attrs
import h11
import trio

__all__ = [
    "CLOSED_AFTER_ANSWER",
    "ConnectionPool",
    "closed_after_answer",
    "is_reusable",
    "next_expiry",
    "put_idle",
    "reusable_now",
    "sweep_idle",
    "take_idle",
    "unread",
]

logger = logging.getLogger("trio_failover")


class _Idle(Protocol):
    @property
    def idle_since(self) -> float: ...

    @property
    def chunked(self) -> bool: ...


IdleT = TypeVar("IdleT", bound=_Idle)


def _expired_prefix(idle: Sequence[_Idle], now: float, idle_timeout: float) -> int:
    # Released in time order, so the list is sorted by idle_since and the
    # expired entries are a prefix of it.
    # The same sum as ``next_expiry``'s: ``now - idle_since < idle_timeout``
    # can round the other way (9.2 - 5.2 < 4.0), and the watcher, woken at
    # the expiry it computed, would find nothing due and spin.
    count = 0
    for entry in idle:
        if now < entry.idle_since + idle_timeout:
            break
        count += 1
    return count


def take_idle(
    idle: list[IdleT], *, now: float, idle_timeout: float, streams_kept: bool = True
) -> tuple[IdleT | None, list[IdleT]]:
    """Check out the newest usable connection of one node.

    Args:
        idle: the node's idle connections, oldest first; changed in place.
        now: the current Trio time.
        idle_timeout: seconds after which an idle connection is not reused.
        streams_kept: the node has kept a streamed answer's connection alive
            (``reusable_now``); else such connections younger than
            ``CLOSED_AFTER_ANSWER`` stay where they are.

    Returns:
        ``(connection or None, expired connections to close)``.
    """
    expired = _expired_prefix(idle, now, idle_timeout)
    discarded = idle[:expired]
    del idle[:expired]
    for index in range(len(idle) - 1, -1, -1):  # newest first; nearly always the first
        entry = idle[index]
        if reusable_now(entry.chunked, now - entry.idle_since, streams_kept):
            return idle.pop(index), discarded
    return None, discarded


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


def sweep_idle(
    idle: list[IdleT], *, now: float, idle_timeout: float, dead: Callable[[IdleT], bool]
) -> list[IdleT]:
    """Take out the idle connections of one node that must close now.

    Args:
        idle: the node's idle connections, oldest first; changed in place.
        now: the current Trio time.
        idle_timeout: seconds after which an idle connection is not reused.
        dead: whether a connection turned readable while idle (closed by
            the node, or sent bytes nobody asked for).

    Returns:
        The expired and the dead connections, oldest first.
    """
    expired = _expired_prefix(idle, now, idle_timeout)
    discarded = idle[:expired]
    kept = [entry for entry in idle[expired:] if not dead(entry)]
    discarded += [entry for entry in idle[expired:] if dead(entry)]
    idle[:] = kept
    return discarded


def next_expiry(idle: Mapping[str, Sequence[_Idle]], idle_timeout: float) -> float:
    """When the next idle connection expires (``math.inf`` with none idle).

    Each node's list is oldest first, so only its first entry counts.
    """
    return min(
        (entries[0].idle_since + idle_timeout for entries in idle.values() if entries),
        default=math.inf,
    )


def is_reusable(conn: h11.Connection) -> bool:
    """Whether a client-side h11 connection may carry another request.

    Both messages must have ended cleanly (a ``Connection: close`` or an
    HTTP/1.0 answer leaves h11 in ``MUST_CLOSE``), and nothing may follow
    the response: extra bytes would be taken for the next answer.
    """
    data, closed = conn.trailing_data
    return conn.our_state is h11.DONE and conn.their_state is h11.DONE and not data and not closed


# A node that closes a pooled connection this soon after the answer it
# carried does not keep such connections alive, whatever its headers said
# (llama-server closes each one after a streamed answer, an instant after
# its last chunk): from then on the pool closes them at release. Until a
# node has kept one connection of a streamed answer alive this long, such
# connections are not reused sooner (``reusable_now``).
CLOSED_AFTER_ANSWER = 1.0


def closed_after_answer(idle_for: float) -> bool:
    """Whether a node's close of a connection ``idle_for`` seconds after its answer ended it."""
    return idle_for < CLOSED_AFTER_ANSWER


def reusable_now(chunked: bool, idle_for: float, kept_alive_before: bool) -> bool:
    """Whether an idle connection may carry a request now.

    One whose answer was streamed (chunked) waits out ``CLOSED_AFTER_ANSWER``
    unless its node has kept such a connection alive before: the node may
    be about to close it, and a request that met the close could not be
    sent to that node again (the node may have read it).
    """
    return not chunked or kept_alive_before or idle_for >= CLOSED_AFTER_ANSWER


@attrs.define(slots=True)
class IdleConnection:
    """A connection to a node, with its h11 state, kept for the next request.

    ``chunked``: its last answer came in chunks (a stream, nearly always).
    """

    stream: trio.abc.Stream
    conn: h11.Connection
    idle_since: float
    fd: int = -1  # its socket's descriptor while the watcher watches it
    chunked: bool = False


# How long a released connection may wait, unwatched, for the watcher's next
# look: a node's close is then noticed within this (the rule: a second).
WATCH_DELAY = 0.25


class ConnectionPool:
    """Idle keep-alive connections to nodes, by node name.

    Args:
        max_idle: the most idle connections per node (``0``: no pooling).
        idle_timeout: seconds after which an idle connection is not reused
            (``0``: no pooling).
        on_stray: called with a node's name each time one of its
            connections is found with stray bytes (the proxy counts them).

    Cancellation: ``acquire`` and ``release`` never lose a connection; what
    they discard is closed with ``trio.aclose_forcefully`` even when the
    caller is being cancelled.
    """

    origins: dict[str, object] | None = (
        None  # after a reload: each name's node (UpstreamResponse.release)
    )

    def __init__(
        self,
        *,
        max_idle: int,
        idle_timeout: float,
        on_stray: Callable[[str], None] | None = None,
    ) -> None:
        self.max_idle, self.idle_timeout = max_idle, idle_timeout
        self.on_stray = on_stray
        self._idle: dict[str, list[IdleConnection]] = {}
        # (node, chunked): the answers after which the node closes the
        # connection (``closed_after_answer``); those are not pooled.
        self._closed_after: set[tuple[str, bool]] = set()
        # Nodes seen keeping a connection of a streamed answer alive for
        # ``CLOSED_AFTER_ANSWER``: theirs are reused at once (``reusable_now``).
        self._streams_kept: set[str] = set()
        # One poll object for the checkout look: registering an fd in it is
        # no system call, and its poll(0) is the only one.
        self._poller = select.poll() if hasattr(select, "poll") else None
        self._readiness: IdleSocketWatch | None = None  # while ``watch`` runs
        self._wake = trio.Event()  # set on release: the watcher may have a deadline now
        # Released connections not yet in the epoll set, and when the
        # watcher looks for them; its wait's scope, while it waits with a
        # deadline (a release moves it earlier).
        self._unwatched = False
        self._look_due = math.inf
        self._look: trio.CancelScope | None = None
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

    async def acquire(self, node: str, *, now: float | None = None) -> IdleConnection | None:
        """The newest unexpired idle connection to ``node`` with nothing unread, or None.

        The h11 state is ready for the next request. ``now``: the Trio clock,
        if the caller read it since its last checkpoint. A connection with
        bytes or an EOF waiting is closed and the next one looked at.
        """
        idle = self._idle.get(node)
        if not idle:
            return None
        if now is None:
            now = trio.current_time()
        kept = node in self._streams_kept
        for _ in range(self.max_idle + 1):  # each turn takes one out: bounded
            entry, expired = take_idle(
                idle, now=now, idle_timeout=self.idle_timeout, streams_kept=kept
            )
            if entry is not None:
                self._unwatch(entry)  # in use now: its bytes are the answer's
                waiting = unread(entry.stream, self._poller)
                if waiting is not None:
                    if waiting == "bytes":
                        self._stray(node)
                    else:
                        self.closed_by_node(node, entry, now)
                    expired.append(entry)
                    entry = None
                elif entry.chunked and not kept:  # alive a second after a stream
                    self._streams_kept.add(node)
            try:
                if expired:  # nearly always none: no coroutine to make and await
                    await self._close_all(expired)
            except BaseException:
                if entry is not None:
                    await trio.aclose_forcefully(entry.stream)
                raise
            if entry is not None or not idle:
                return entry
        return None

    def _stray(self, node: str) -> None:
        """A connection of ``node`` had bytes after a complete answer: say so, count it."""
        # The bytes are not logged: they may be (the end of) another
        # client's answer.
        logger.warning("stray bytes after a complete answer", extra={"fields": {"node": node}})
        if self.on_stray is not None:
            self.on_stray(node)

    def closed_by_node(self, node: str, entry: IdleConnection, now: float) -> None:
        """``node`` closed ``entry``, pooled, at ``now``: soon after its answer, it is learnt.

        Called by the pool's own looks (at checkout, by the watcher) and by
        an attempt whose write on a pooled connection the node answered
        with a close. A node that closes connections right after one kind
        of answer (chunked or not) gets no such connection pooled again.
        """
        kind = (node, entry.chunked)
        if kind in self._closed_after or not closed_after_answer(now - entry.idle_since):
            return
        self._closed_after.add(kind)
        logger.info(
            "node closes its connections after its answers: they are not pooled",
            extra={"fields": {"node": node, "chunked": entry.chunked}},
        )

    async def release(
        self, node: str, stream: trio.abc.Stream, conn: h11.Connection, *, chunked: bool = False
    ) -> None:
        """Keep a connection whose exchange ended cleanly, or close it.

        Args:
            node: the node's name.
            stream: the connection.
            conn: its client-side h11 state, after a complete response.
            chunked: the answer came in chunks (``Transfer-Encoding: chunked``).
        """
        if not self.enabled or not is_reusable(conn) or (node, chunked) in self._closed_after:
            if conn.their_state is h11.DONE and conn.trailing_data[0]:
                self._stray(node)  # came in the same read as the answer's end
            await trio.aclose_forcefully(stream)
            return
        conn.start_next_cycle()
        now = trio.current_time()
        entry = IdleConnection(stream, conn, now, chunked=chunked)
        discarded = put_idle(
            self._idle.setdefault(node, []),
            entry,
            now=now,
            idle_timeout=self.idle_timeout,
            max_idle=self.max_idle,
        )
        self._ask_look(now)
        if discarded:
            await self._close_all(discarded)

    def _ask_look(self, now: float) -> None:
        """Have the watcher add released connections to its set within ``WATCH_DELAY``."""
        self._wake.set()  # it may be waiting for any idle connection at all
        if self._unwatched:
            return  # a look is due already, and sooner
        self._unwatched, self._look_due = True, now + WATCH_DELAY
        look = self._look
        if look is not None and self._look_due < look.deadline:
            look.deadline = self._look_due

    async def watch(self) -> None:
        """Close idle connections once expired or closed by their node; runs until cancelled.

        The pool's one watcher: run it in a nursery that lives as long as the
        pool (``Proxy.run`` does). It waits for the earliest idle deadline
        or for any idle socket to turn readable, and closes what is due.
        """
        if not self.enabled:
            await trio.sleep_forever()
        readiness = self._readiness = IdleSocketWatch()
        try:
            for entries in self._idle.values():
                for entry in entries:
                    entry.fd = readiness.add(entry.stream)
            while True:
                deadline = next_expiry(self._idle, self.idle_timeout)
                if self._unwatched:
                    deadline = min(deadline, self._look_due)
                if deadline == math.inf:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                with trio.move_on_at(deadline) as self._look:
                    await readiness.wait()
                self._look = None
                if self._unwatched:
                    self._unwatched = False
                    for entries in self._idle.values():
                        for entry in entries:
                            if entry.fd < 0:
                                entry.fd = readiness.add(entry.stream)
                await self._sweep(readiness)
        finally:
            self._readiness = self._look = None
            self._unwatched = False
            for entries in self._idle.values():
                for entry in entries:
                    entry.fd = -1
            readiness.close()

    async def _sweep(self, readiness: IdleSocketWatch) -> None:
        ready = readiness.ready()
        now = trio.current_time()
        doomed: list[IdleConnection] = []
        for node, entries in self._idle.items():
            closing = sweep_idle(
                entries, now=now, idle_timeout=self.idle_timeout, dead=lambda e: e.fd in ready
            )
            for entry in closing:
                if entry.fd not in ready:
                    continue
                if unread(entry.stream, self._poller) == "bytes":
                    self._stray(node)
                else:
                    self.closed_by_node(node, entry, now)
            doomed += closing
        for fd in ready:  # one that is no longer idle must not wake the watcher again
            readiness.forget(fd)
        await self._close_all(doomed)

    def _unwatch(self, entry: IdleConnection) -> None:
        if self._readiness is not None:
            self._readiness.forget(entry.fd)
        entry.fd = -1

    async def _close_all(self, entries: list[IdleConnection]) -> None:
        for entry in entries:  # out of the epoll set before its descriptor is reused
            self._unwatch(entry)
        for entry in entries:
            await trio.aclose_forcefully(entry.stream)

    async def aclose(self, node: str | None = None) -> None:
        """Close every idle connection (at shutdown), or ``node``'s (a reload removed it)."""
        idle = self._idle if node is None else {node: self._idle.pop(node, [])}
        self._closed_after = {kind for kind in self._closed_after if node not in (None, kind[0])}
        self._streams_kept = set() if node is None else self._streams_kept - {node}
        entries = [entry for listed in idle.values() for entry in listed]
        idle.clear()
        await self._close_all(entries)


def _close_abandoned(idle: dict[str, list[IdleConnection]]) -> None:
    """Close the sockets of a pool that was dropped, outside any Trio run."""
    for entries in idle.values():
        for entry in entries:
            detach_and_close(entry.stream)
    idle.clear()


# The pool's look at its idle sockets: one epoll set for the watcher, the
# checkout check. ``ConnectionPool`` decides which idle connections close;
# these only ask the kernel (and the TLS object) what waits on them. Nothing
# here is a checkpoint but ``IdleSocketWatch.wait``.

Unread = Literal["bytes", "eof"]


class IdleSocketWatch:
    """Idle sockets in one epoll set, whose own descriptor Trio can wait on.

    Where ``select.epoll`` does not exist, nothing is watched and ``wait``
    only ends by its deadline: idle connections then close at expiry only.
    The set is level-triggered: a socket that has bytes or an EOF waiting
    when it is added wakes the watcher at once.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None

    def add(self, stream: trio.abc.Stream) -> int:
        """Watch ``stream``'s socket; its descriptor, or -1 when it is not watched."""
        fd = socket_fd(stream)
        if self._epoll is None or fd < 0:
            return -1  # an in-memory stream (tests): deadlines only
        # EPOLLIN: bytes (stray ones: an idle connection has no answer
        # pending) or an EOF; EPOLLRDHUP: the node's FIN.
        events = select.EPOLLIN | select.EPOLLRDHUP
        try:
            self._epoll.register(fd, events)
        except FileExistsError:  # a descriptor number reused before we heard of its close
            self._epoll.modify(fd, events)
        return fd

    def forget(self, fd: int) -> None:
        if self._epoll is not None and fd >= 0:
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)

    async def wait(self) -> None:
        if self._epoll is None:
            await trio.sleep_forever()
        else:
            await trio.lowlevel.wait_readable(self._epoll.fileno())

    def ready(self) -> Collection[int]:
        if self._epoll is None:
            return frozenset()
        return {fd for fd, _ in self._epoll.poll(0)}

    def close(self) -> None:
        if self._epoll is not None:
            trio.lowlevel.notify_closing(self._epoll.fileno())
            self._epoll.close()


def unread(stream: trio.abc.Stream, poller: select.poll | None) -> Unread | None:
    """What waits unread on an idle connection: ``"bytes"``, ``"eof"``, or None (nothing).

    One ``poll`` system call with a zero timeout when nothing waits (nearly
    always): registering in ``poller`` is no system call. A connection found
    with anything waiting is closed by the caller, so what waits may be
    read (not peeked) to say what it is. A stream without a socket
    (in-memory, in tests) is not looked at.
    """
    fd = socket_fd(stream)
    if isinstance(stream, trio.SSLStream):
        return _tls_unread(stream, fd, poller)
    if not _readable(fd, poller):
        return None
    try:
        data = os.read(fd, 1)
    except OSError:  # a reset (or readable, yet nothing to read): unusable all the same
        return "eof"
    return "bytes" if data else "eof"


def _readable(fd: int, poller: select.poll | None) -> bool:
    if fd < 0 or poller is None:
        return False
    poller.register(fd, select.POLLIN)
    try:
        return bool(poller.poll(0))
    finally:
        poller.unregister(fd)


def _tls_unread(stream: trio.SSLStream[Any], fd: int, poller: select.poll | None) -> Unread | None:
    """``unread`` for TLS: the TLS object's buffers, then the socket, decrypted to tell.

    Trio's SSLStream keeps received records in a MemoryBIO until its SSL
    object asks for them: bytes there were never decrypted, so h11 never
    saw them. On the wire (TLS 1.3) a stray answer and the node's
    ``close_notify`` look the same, so what came is decrypted: application
    data is stray bytes; a ``close_notify``, a partial record or a
    handshake message is an EOF (closed all the same, not counted). The
    BIO and the SSL object are Trio's private attributes, read with
    defaults: without them, anything waiting is an EOF.
    """
    if stream.pending():  # decrypted application data that nobody read
        return "bytes"
    incoming = getattr(stream, "_incoming", None)
    ssl_object = getattr(stream, "_ssl_object", None)
    if not getattr(incoming, "pending", 0) and not _readable(fd, poller):
        return None
    if incoming is None or ssl_object is None:
        return "eof"
    try:
        data = os.read(fd, 65536) if fd >= 0 else b""
    except BlockingIOError:
        data = b""
    except OSError:
        return "eof"
    if data:
        incoming.write(data)
    try:
        return "bytes" if ssl_object.read(1) else "eof"
    except ssl.SSLError:  # close_notify (SSLZeroReturnError), want-read, or broken
        return "eof"


def socket_fd(stream: trio.abc.Stream) -> int:
    """The descriptor of the socket under ``stream`` (TLS: its transport's), else -1."""
    transport = getattr(stream, "transport_stream", stream)  # TLS
    sock = getattr(transport, "socket", None)
    return sock.fileno() if isinstance(sock, trio.socket.SocketType) else -1


def detach_and_close(stream: trio.abc.Stream) -> None:
    """Close the socket under ``stream`` outside any Trio run (no task waits on it).

    Trio's own ``close`` needs a running Trio loop, which may be gone by
    now; detaching the file descriptor and closing that is all there is to do.
    """
    transport = getattr(stream, "transport_stream", stream)  # TLS
    sock = getattr(transport, "socket", None)
    if isinstance(sock, trio.socket.SocketType):
        fd = sock.detach()
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
