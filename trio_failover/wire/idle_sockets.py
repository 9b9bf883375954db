"""The pool's look at its idle sockets: one epoll set for the watcher, the checkout check.

``pool.py`` decides which idle connections close; this module only asks
the kernel (and the TLS object) what waits on them. Nothing here is a
checkpoint but ``Readiness.wait``.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Collection
from typing import Literal

import trio

__all__ = ["Readiness", "Unread", "detach_and_close", "socket_fd", "unread"]

Unread = Literal["bytes", "eof"]


class Readiness:
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


# The first byte of a TLS record says its type (RFC 8446 section 5.1).
_TLS_ALERT = 0x15


def unread(stream: trio.abc.Stream, poller: select.poll | None) -> Unread | None:
    """What waits unread on an idle connection: ``"bytes"``, ``"eof"``, or None (nothing).

    One ``poll`` system call with a zero timeout when nothing waits (nearly
    always): registering in ``poller`` is no system call. A connection found
    readable is read, not peeked, by one byte: it is closed anyway. TLS: the
    bytes the TLS object holds (decrypted, or records not yet decrypted)
    count as bytes; on the socket, a record that begins with an alert is
    the node's ``close_notify``, an EOF. A stream without a socket
    (in-memory, in tests) is not looked at.
    """
    if isinstance(stream, trio.SSLStream):
        # Trio's SSLStream keeps received records in its MemoryBIO until
        # the SSL object asks for them: bytes there were never decrypted,
        # so h11 never saw them. (Private, so read with a default.)
        incoming = getattr(stream, "_incoming", None)
        if stream.pending() or getattr(incoming, "pending", 0):
            return "bytes"
    fd = socket_fd(stream)
    if fd < 0 or poller is None:
        return None
    poller.register(fd, select.POLLIN)
    try:
        if not poller.poll(0):
            return None
    finally:
        poller.unregister(fd)
    try:
        data = os.read(fd, 1)
    except OSError:  # a reset (or readable, yet nothing to read): unusable all the same
        return "eof"
    if not data or (isinstance(stream, trio.SSLStream) and data[0] == _TLS_ALERT):
        return "eof"
    return "bytes"


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
