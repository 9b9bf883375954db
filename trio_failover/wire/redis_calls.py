"""The calls in flight on one ``RedisConnection``: whose replies come next, and where they go.

Replies come back in the order the commands were written; ``InFlight``
hands each one to the oldest call still waiting for some, whether its
caller waits for it (``execute``: woken when they are in), left (a
deadline or a cancellation: the replies are read and dropped), or never
waited (``post``: a callback takes them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
import hiredis
import trio

from ..core.errors import StateError, StateUnavailable
from . import socket_io
from .redis_link import IO_ERRORS, READ_SIZE, Link

__all__ = ["Call", "InFlight", "OnReplies", "Replies"]

# What a posted call's replies go to: the replies, or the error that ended it.
OnReplies = Callable[[list[object] | StateError], None]


@attrs.define(eq=False, slots=True)
class Call:
    """One caller's commands in flight; the replies come in as they are read."""

    expected: int
    replies: list[object] = attrs.Factory(list)
    error: StateError | None = None
    done: bool = False
    # Set while the caller waits for another task to read its replies:
    # set() when they are in, or when it is this caller's turn to read.
    wake: trio.Event | None = None
    # A posted call (``RedisConnection.post``): nobody waits; called when it ends.
    on_done: OnReplies | None = None

    def finish(self) -> None:
        """The replies are in, or the call failed: wake its caller, or tell its callback."""
        self.done = True
        if self.wake is not None:
            self.wake.set()
        if self.on_done is not None:
            self.on_done(self.error if self.error is not None else self.replies)


class InFlight:
    """The calls whose commands were written, oldest first: where each reply read goes."""

    def __init__(self) -> None:
        self._calls: deque[Call] = deque()

    def add(self, call: Call) -> None:
        """``call``'s commands are being written: its replies come after the others'."""
        self._calls.append(call)

    def deliver(self, reply: object) -> bool:
        """Hand one reply to the oldest call (kept, if its caller left); False: no call waits."""
        if not self._calls:
            return False
        call = self._calls[0]
        call.replies.append(reply)
        if len(call.replies) == call.expected:
            self._calls.popleft()
            call.finish()
        return True

    def first_is_posted(self) -> bool:
        """Whether the oldest call is a posted one, whose replies nobody waits to read."""
        return bool(self._calls) and self._calls[0].on_done is not None

    def wake_next_reader(self) -> None:
        """Wake the first caller still waiting: it reads next."""
        for call in self._calls:
            if call.wake is not None:
                call.wake.set()
                return

    def fail_all(self, reason: str) -> None:
        """End every call with ``StateUnavailable`` for ``reason``."""
        while self._calls:
            call = self._calls.popleft()
            call.error = StateUnavailable("reply", reason)
            call.finish()


class Replies:
    """The read side of one connection: who reads the socket, and where each reply goes.

    A caller whose replies are not in yet reads the socket itself, unless
    another caller already does, and hands every reply it reads to the
    call it belongs to. When a reading caller leaves (its replies are in,
    its deadline passed, it was cancelled) the next waiting one takes
    over. Cancelling a read loses nothing: Trio's socket and (after its
    handshake) TLS streams give up before taking any bytes. ``lose`` is the
    connection's: it marks it closed and fails every call.
    """

    def __init__(self, link: Link, lose: Callable[[str], None]) -> None:
        self.link = link
        self.pending = InFlight()
        self._reading = False
        self._lose = lose

    async def wait(self, call: Call) -> None:
        """Until ``call``'s replies are in: read them, or wait while another task reads."""
        try:
            if not self._reading and self.pending.first_is_posted():
                self._read_now()  # posted replies that came meanwhile, without a wait
            while not call.done:
                if self._reading:
                    call.wake = trio.Event()
                    await call.wake.wait()
                    continue
                self._reading = True
                try:
                    await self._read_some()
                finally:
                    self._reading = False
        finally:
            call.wake = None
            if not self._reading:  # let the first caller still waiting read
                self.pending.wake_next_reader()

    async def _read_some(self) -> None:
        """One read from the socket (``socket_io`` waits first: the reply is never there yet)."""
        try:
            data = await socket_io.receive(self.link.stream, READ_SIZE)
        except IO_ERRORS as exc:
            self._lose(f"connection lost: {exc.__cause__ or exc}")
            return
        self._take_in(data)

    def _read_now(self) -> None:
        """Take in what the kernel already holds (no wait, not a checkpoint)."""
        try:
            data = socket_io.read_now(self.link.stream, READ_SIZE)
        except IO_ERRORS as exc:
            self._lose(f"connection lost: {exc.__cause__ or exc}")
            return
        if data is not None:
            self._take_in(data)

    def _take_in(self, data: bytes) -> None:
        """Every whole reply in ``data`` to its call; b"" is the server's end."""
        if not data:
            self._lose("the server closed the connection")
            return
        parser = self.link.parser
        try:
            parser.feed(data)
            while (reply := parser.gets()) is not False:
                if not self.pending.deliver(reply):
                    self._lose("a reply nobody asked for")
        except hiredis.ProtocolError as exc:
            self._lose(f"not Redis' protocol: {exc}")
