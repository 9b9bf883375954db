"""The pool's look at its idle sockets: one epoll set for the watcher, the checkout check.

``pool.py`` decides which idle connections close; this module only asks
the kernel (and the TLS object) what waits on them. Nothing here is a
checkpoint but ``IdleSocketWatch.wait``.
"""

from __future__ import annotations

import contextlib
import os
import select
import ssl
from collections.abc import Collection
from typing import Any, Literal

import trio

__all__ = ["IdleSocketWatch", "Unread", "detach_and_close", "socket_fd", "unread"]

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
