"""Reads and writes on plain TCP streams with fewer system calls and yields.

Trio's ``SocketStream.receive_some`` first tries the read and, when nothing
has arrived (nearly always for the proxy: it reads right after it wrote),
takes a ``BlockingIOError`` and then waits. Its ``send_all`` yields to the
scheduler after every complete write. In the relay of a stream both happen
once per chunk, and each costs about as much as the useful work. So on a
plain ``trio.SocketStream`` these functions wait for readability first and
then read once, and write at once without a yield when the kernel takes the
whole buffer. A new client connection is the other way round: its
request has nearly always arrived by the time its task runs, so
``read_now`` reads it without waiting. Any other stream (TLS, in-memory
streams in tests, the admin side) goes through Trio's own methods
unchanged.

Checkpoints: ``receive`` always is one (it waits). ``send`` is one only
when the write did not go through at once; the relay loop's next
``receive`` is its checkpoint. ``read_now`` and ``write_now`` never are.
"""

from __future__ import annotations

import os
import sys

import trio

RECEIVE_SIZE = 65536

# A socket is a file descriptor that os.read and os.write accept on POSIX
# systems; on Windows it is a handle they do not, and Trio's methods serve.
_POSIX_SOCKETS = sys.platform != "win32"


def _plain_fd(stream: object) -> int:
    """The socket's descriptor under a plain, open ``trio.SocketStream``, else -1.

    -1 also for a socket closed or shut down for writing: Trio's methods
    then raise the error they document.
    """
    if (
        _POSIX_SOCKETS
        and type(stream) is trio.SocketStream
        and not stream.socket.did_shutdown_SHUT_WR
    ):
        return stream.socket.fileno()
    return -1


async def receive(stream: trio.abc.ReceiveStream, size: int = RECEIVE_SIZE) -> bytes:
    """Up to ``size`` bytes, b"" at EOF: ``receive_some``, waiting before the read.

    Raises:
        trio.ClosedResourceError: the stream was closed (before or during the wait).
        trio.BrokenResourceError: the read failed (reset, dead peer), with the
            ``OSError`` as its cause, as ``receive_some`` raises it.
    """
    fd = _plain_fd(stream)
    if fd < 0:
        return bytes(await stream.receive_some(size))
    await trio.lowlevel.wait_readable(fd)
    try:
        return os.read(fd, size)
    except BlockingIOError:  # woken, yet nothing to read: Trio's way from here
        return bytes(await stream.receive_some(size))
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


def read_now(stream: trio.abc.ReceiveStream, size: int = RECEIVE_SIZE) -> bytes | None:
    """What the kernel already holds of ``stream``'s input, without waiting.

    Not a checkpoint. b"" at EOF; None when nothing has arrived, or when
    ``stream`` is not a plain, open socket stream (nothing was read).

    Raises:
        trio.BrokenResourceError: the read failed (reset, dead peer), with
            the ``OSError`` as its cause, as ``receive_some`` raises it.
    """
    fd = _plain_fd(stream)
    if fd < 0:
        return None
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


def write_now(stream: trio.abc.SendStream, data: bytes) -> int:
    """Write what the kernel takes of ``data`` at once, without waiting; how much.

    Not a checkpoint. -1 when ``stream`` is not a plain, open socket stream
    (nothing was written: use its ``send_all``).

    Raises:
        trio.BrokenResourceError: the write failed (reset, dead peer), with
            the ``OSError`` as its cause, as ``send_all`` raises it.
    """
    fd = _plain_fd(stream)
    if fd < 0 or not data:
        return -1
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


async def send(stream: trio.abc.SendStream, data: bytes) -> None:
    """Write all of ``data``: at once when the kernel takes it, else ``send_all``.

    Raises:
        trio.BrokenResourceError, trio.ClosedResourceError: as ``send_all``.
    """
    sent = write_now(stream, data)
    if sent < 0:
        await stream.send_all(data)
    elif sent < len(data):
        await stream.send_all(memoryview(data)[sent:])
