"""The stream-idle timer of a committed stream: no deadline per chunk, no task per stream.

``--stream-idle-timeout`` bounds the node's silence, and only while the
proxy waits for the node: the time it spends writing to a slow client is
not the node's (SPEC 5.6). A cancel scope whose deadline follows every
chunk would have to be lifted before each write to the client and set again
after it; in Trio each move is a registration in the run loop's deadline
heap, about a tenth of the instructions of a relayed chunk. So the relay
only notes, in plain attributes of its ``SilenceTimer``, when each wait for
the node began and how much silence came before it.

Who looks at those notes: ``SilenceWatch.watch``, one task per proxy (one
of the proxy's own, ``Proxy.run``), which keeps every committed stream's
timer in one heap by the earliest moment its silence could reach the
timeout, sleeps until the first of them and looks. A task per stream would
cost ~5 KiB of memory per open stream (docs/performance.md, "Memory"); a
heap entry costs a tuple.

The watch cancels the relay's scope only while the relay waits
for the node, never while it writes, so a cancellation can only end a wait.
A chunk that arrives in the very pass in which the timer fires finds the
scope cancelled (``fired``) and is not relayed: the stream timed out at its
deadline.
"""

from __future__ import annotations

import heapq
import itertools

import trio

__all__ = ["SilenceTimer", "SilenceWatch"]


class SilenceTimer:
    """Cancels ``scope`` once the node was silent ``timeout`` seconds while awaited.

    The relay runs inside ``scope`` and, per chunk, sets ``waiting_since``
    (``trio.current_time()``) before it waits for the node and ``None``
    after; ``silence`` is the node's silence before that wait, since the
    last chunk of progress (0.0 after one). ``armed`` is False until the
    stream's first progress (an event stream's first event line): before
    it, the wait is unbounded (SPEC 5.5). ``SilenceWatch`` times it
    (``register``/``unregister``).
    """

    __slots__ = (
        "armed",
        "queued",
        "scope",
        "silence",
        "stopped",
        "timeout",
        "waiting_since",
    )

    def __init__(self, timeout: float, *, armed: bool) -> None:
        self.timeout = timeout
        self.armed = armed
        self.scope = trio.CancelScope()
        self.waiting_since: float | None = None
        self.silence = 0.0
        self.stopped = False
        self.queued = False  # whether a SilenceWatch heap holds it

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


# Below this many stopped entries the heap is not rebuilt: they leave it
# at their expiry anyway, within one timeout.
_COMPACT_MIN = 64


class SilenceWatch:
    """Every committed stream's ``SilenceTimer`` of a proxy, timed by one task.

    ``watch`` is that task: the proxy runs it for its lifetime
    (``Proxy.run``). A stream ``register``s its timer before the relay and ``unregister``s it after;
    each is O(log n), and the relay does no heap work per chunk. A stopped
    timer stays in the heap until its entry comes due or the stopped
    entries are the majority, when the heap is rebuilt without them.
    """

    __slots__ = ("_heap", "_seq", "_stale", "_wake", "running")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, SilenceTimer]] = []
        self._seq = itertools.count()  # ties in expiry never compare timers
        self._stale = 0  # stopped timers still in the heap
        self._wake = trio.Event()  # set when an entry is earlier than all before it
        self.running = False

    @property
    def timed(self) -> int:
        """How many streams it times now."""
        return len(self._heap) - self._stale

    def register(self, timer: SilenceTimer) -> None:
        """Time ``timer`` from now on, until ``unregister``."""
        expiry = timer.expiry(trio.current_time())
        if expiry is None:  # only an armed relay already waiting: not at registration
            timer.scope.cancel()
            return
        self._push(expiry, timer)

    def unregister(self, timer: SilenceTimer) -> None:
        """Stop timing ``timer`` (its stream ended, whichever way)."""
        timer.stopped = True
        if not timer.queued:
            return
        self._stale += 1
        heap = self._heap
        if self._stale > _COMPACT_MIN and 2 * self._stale > len(heap):
            live = [entry for entry in heap if not entry[2].stopped]
            for entry in heap:
                if entry[2].stopped:
                    entry[2].queued = False
            heapq.heapify(live)
            self._heap, self._stale = live, 0

    def _push(self, expiry: float, timer: SilenceTimer) -> None:
        heap = self._heap
        # Only an entry earlier than every other one moves the watcher's
        # wake-up; it is then at the heap's top.
        earlier = not heap or expiry < heap[0][0]
        heapq.heappush(heap, (expiry, next(self._seq), timer))
        timer.queued = True
        if earlier:
            self._wake.set()

    async def watch(self) -> None:
        """Cancel each stream whose node went silent too long; runs until cancelled."""
        if self.running:
            raise RuntimeError("SilenceWatch.watch is already running")
        self.running = True
        try:
            while True:
                if self._wake.is_set():
                    self._wake = trio.Event()
                if not self._heap:
                    await self._wake.wait()
                    continue
                with trio.move_on_at(self._heap[0][0]):
                    await self._wake.wait()
                self._expire(trio.current_time())
        finally:
            # The streams still registered lose their timing; serve() stops
            # the proxy only after its connections (or when all is cancelled).
            self.running = False

    def _expire(self, now: float) -> None:
        """Look at every entry due by ``now``: fire, push again later, or drop."""
        heap = self._heap
        later: list[tuple[float, SilenceTimer]] = []
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            timer.queued = False
            if timer.stopped:
                self._stale -= 1
                continue
            expiry = timer.expiry(now)
            if expiry is None:
                timer.scope.cancel()
            else:  # pushed after the loop: each timer is looked at once per pass
                later.append((expiry, timer))
        for expiry, timer in later:  # the watcher's next sleep reads the top itself
            heapq.heappush(heap, (expiry, next(self._seq), timer))
            timer.queued = True
