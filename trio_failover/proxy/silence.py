"""The stream-idle timer of a committed stream: a task per stream, no deadline per chunk.

``--stream-idle-timeout`` bounds the node's silence, and only while the
proxy waits for the node: the time it spends writing to a slow client is
not the node's (SPEC 5.6). A cancel scope whose deadline follows every
chunk would have to be lifted before each write to the client and set again
after it; in Trio each move is a registration in the run loop's deadline
heap, about a tenth of the instructions of a relayed chunk. So the relay
only notes, in plain attributes, when each wait for the node began and how
much silence came before it, and one task per stream sleeps until the
earliest moment that silence could reach the timeout, then looks.

The task cancels the relay's scope only while the relay waits for the node,
never while it writes, so a cancellation can only end a wait. A chunk that
arrives in the very pass in which the timer fires finds the scope cancelled
(``fired``) and is not relayed: the stream timed out at its deadline.
"""

from __future__ import annotations

import trio


class SilenceTimer:
    """Cancels ``scope`` once the node was silent ``timeout`` seconds while awaited.

    The relay runs inside ``scope`` and, per chunk, sets ``waiting_since``
    (``trio.current_time()``) before it waits for the node and ``None``
    after; ``silence`` is the node's silence before that wait, since the
    last chunk of progress (0.0 after one). ``armed`` is False until the
    stream's first progress (an event stream's first event line): before
    it, the wait is unbounded (SPEC 5.5). ``run`` is the task; ``stop``
    ends it.
    """

    __slots__ = ("_done", "armed", "scope", "silence", "timeout", "waiting_since")

    def __init__(self, timeout: float, *, armed: bool) -> None:
        self.timeout = timeout
        self.armed = armed
        self.scope = trio.CancelScope()
        self.waiting_since: float | None = None
        self.silence = 0.0
        self._done = trio.Event()

    @property
    def fired(self) -> bool:
        """Whether the timer ended the stream."""
        return self.scope.cancel_called

    def expiry(self, now: float) -> float | None:
        """When the silence reaches the timeout at the earliest; None: it has, now."""
        since = self.waiting_since
        if not self.armed or since is None:
            # No progress yet, or the relay is writing: the silence cannot
            # end sooner than a whole (remaining) timeout from now.
            return now + (self.timeout - (self.silence if self.armed else 0.0))
        expiry = since + (self.timeout - self.silence)
        return None if now >= expiry else expiry

    async def run(self) -> None:
        """Sleep until each possible expiry, and cancel the scope at the real one."""
        while not self._done.is_set():
            expiry = self.expiry(trio.current_time())
            if expiry is None:
                self.scope.cancel()
                return
            with trio.move_on_at(expiry):
                await self._done.wait()

    def stop(self) -> None:
        """End ``run`` (by a return, not a cancellation)."""
        self._done.set()
