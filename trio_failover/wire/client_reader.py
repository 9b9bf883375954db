"""The one task that reads a client connection, and doubles as its close watcher.

One reader task per connection receives from the client for the whole
connection lifetime, so a FIN or an RST is seen at any moment, also while an
upstream attempt is pending or a committed stream is silent. Received bytes
are kept (never consumed by the watcher) until the request side takes them,
so a pipelined next request survives. The reader stops receiving once its
limit of bytes wait: it never reads without bound.

A single long-lived reader also means ``receive_some`` is never cancelled in
the middle of a request, which matters for TLS streams.
"""

from __future__ import annotations

import enum

import trio

from . import socket_io
from .http1 import RECEIVE_SIZE

__all__ = ["PENDING_LIMIT", "ClientReader", "Closed", "TakenOver"]

PENDING_LIMIT = 65536


class Closed(enum.Enum):
    """How the client's side of the connection ended."""

    EOF = "eof"  # FIN: the client closed (or half-closed) its sending side
    RESET = "reset"  # RST or another socket error


class ClientReader:
    """The client's bytes as they arrive, kept in ``pending``, and how its side ended.

    ``run`` is the task; everything else is called by the request loop, the
    workload's watcher and the lingering close.
    """

    def __init__(self, stream: trio.abc.Stream, limit: int) -> None:
        self._stream = stream
        self._limit = limit
        self.pending = bytearray()
        self.closed: Closed | None = None
        self._closed_event = trio.Event()
        self._arrived = trio.Event()
        self._room = trio.Event()
        self._watcher: trio.Event | None = None
        self._failed: trio.BrokenResourceError | None = None  # by ``receive_ready``

    def receive_ready(self) -> None:
        """Take the bytes the kernel already holds, without waiting; before ``run`` starts.

        Not a checkpoint. A new connection's request has nearly always
        arrived by the time its task runs; taken here, the request loop
        starts on it in the same step, where waiting for ``run`` would cost
        three passes of the scheduler (the reader task's start, its wait for
        readability, the wake-up), each of them milliseconds under load
        (issue 33). A plain socket stream only; an EOF is left for ``run``
        to meet (it is read again), an error is raised by ``run``.
        """
        try:
            data = socket_io.read_now(self._stream, RECEIVE_SIZE)
        except trio.BrokenResourceError as exc:
            self._failed = exc
            return
        if data:
            self.pending += data

    async def run(self) -> None:
        """Receive client bytes until EOF or error; run in the connection's nursery."""
        try:
            if self._failed is not None:
                raise self._failed
            while True:
                while len(self.pending) >= self._limit:
                    self._room = trio.Event()
                    await self._room.wait()
                data = await socket_io.receive(self._stream, RECEIVE_SIZE)
                if not data:
                    self.closed = Closed.EOF
                    return
                self.pending += data
                self._wake()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = Closed.RESET
        finally:
            self._closed_event.set()
            if self._watcher is not None:
                self._watcher.set()
            self._wake()

    def _wake(self) -> None:
        self._arrived.set()
        self._arrived = trio.Event()

    async def wait_closed(self) -> Closed:
        """Wait until the client's side ends; returns how (FIN or RST)."""
        await self._closed_event.wait()
        assert self.closed is not None
        return self.closed

    def watch(self, event: trio.Event | None) -> None:
        """Set ``event`` too when the client's side ends (None: no longer).

        One workload at a time watches a connection; its watcher waits on an
        event that the workload also sets when it is done, so that the
        watcher ends by returning instead of by a cancellation.
        """
        self._watcher = event

    async def wait_arrival(self) -> None:
        """Wait for the next bytes, or the end of the client's side."""
        await self._arrived.wait()

    async def wait_input(self) -> None:
        """Wait until bytes are pending or the client's side has ended."""
        while not self.pending and self.closed is None:
            await self._arrived.wait()

    def take(self) -> bytes:
        """All pending bytes, removed; the task may receive again."""
        data = bytes(self.pending)
        self.discard()
        return data

    def discard(self) -> None:
        """Drop the pending bytes (and let the task receive again)."""
        self.pending.clear()
        self._room.set()


class TakenOver(trio.abc.Stream):
    """The rest of a client connection, for a protocol that takes it over (a WebSocket).

    The reader task keeps receiving; this stream returns ``replay`` first
    (bytes already consumed, such as the upgrade request h11 parsed, which
    the new protocol wants to read itself), then what the reader holds and
    receives. Sending and closing go to the connection's stream.
    """

    def __init__(self, replay: bytes, reader: ClientReader, stream: trio.abc.Stream) -> None:
        self._ahead = replay
        self._reader = reader
        self._stream = stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """The next bytes; ``b""`` once the client sent its FIN.

        Raises:
            trio.BrokenResourceError: the client's side was reset.
        """
        reader = self._reader
        if self._ahead or reader.pending or reader.closed is not None:
            await trio.lowlevel.checkpoint()
        else:
            await reader.wait_input()
        if not self._ahead:
            if not reader.pending:
                if reader.closed is Closed.RESET:
                    raise trio.BrokenResourceError("the client connection was reset")
                return b""
            self._ahead = reader.take()
        size = len(self._ahead) if max_bytes is None else max_bytes
        data, self._ahead = self._ahead[:size], self._ahead[size:]
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send on the connection's stream."""
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        """As the connection's stream does."""
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Close the connection's stream."""
        await self._stream.aclose()
