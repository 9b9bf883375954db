"""The nodes' silences, timed: stream-idle deadlines and liveness questions, one task.

Two rules need to know how long a node has been silent towards an
attempt, and neither may cost a deadline per relayed chunk:

- ``--stream-idle-timeout`` bounds a committed stream's silence, and only
  while the proxy waits for the node: the time it spends writing to a slow
  client is not the node's (docs/failover.md, "After commit").
- Silence is a question: every ``--liveness-interval`` of silence (from the
  request written until the first body byte, and between the bytes of a
  committed stream) the node is asked ``GET /health`` (``liveness.py``); a
  node that does not answer is marked down, and every attempt still waiting
  on it ends at once.

A cancel scope whose deadline follows every chunk would have to be lifted
before each write to the client and set again after it; in Trio each move
is a registration in the run loop's deadline heap, about a tenth of the
instructions of a relayed chunk. So each wait has a ``SilenceTimer`` whose
plain attributes its owner sets: ``waiting_since`` when a wait for the node
began (None while the relay writes, or before the request is written), and
for an event stream, how much silence came before it.

Who looks at those notes: ``SilenceWatch.watch``, one task per proxy (one
of the proxy's own, ``Proxy.run``). Registering a wait only notes it: almost
every wait ends long before a whole period of silence, so it never costs a
heap entry. Every so often (the shortest first look that a wait registered
since its last scan may need, a liveness interval by default) the watch
scans the waits it has not looked at yet and puts those still running in
one heap by the earliest moment each could be due; it then sleeps until the
first of them and looks. A task per stream would cost ~5 KiB of memory per
open stream (docs/performance.md, "Memory"); a heap entry costs a tuple.

The watch cancels a relay's scope only while the relay waits for the node,
never while it writes, so a cancellation can only end a wait. A chunk that
arrives in the very pass in which the timer fires finds the scope cancelled
(``fired``) and is not relayed: the stream timed out at its deadline.

Ending a wait is the watch's only act: it asks the checker when a question
is due (``ask``), and ends the waits at a node when the checker says the node
did not answer, or when the board marks the node down (``board_changed``).
A committed stream that relayed a byte just before the mark is alive then,
and keeps its wait; if the node is still down when that stream's silence
comes to a question (``down_because``), the stream ends instead of asking.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import trio

from ...core.config import Config, LiveConfig, live_config
from ...core.liveness import moving, next_question, proof_window
from ...core.node_change import ChangeKind, NodeChange

__all__ = ["SilenceTimer", "SilenceWatch"]


class SilenceTimer:
    """One wait for a node, timed: a committed stream's, or an attempt's before commit.

    The owner runs inside ``scope`` and sets ``waiting_since``
    (``trio.current_time()``) before each wait for the node and ``None``
    after; ``silence`` is the node's silence before that wait, since the
    last chunk of progress (0.0 after one). ``armed`` is False until the
    stream's first progress (an event stream's first event line): before
    it, the idle wait is unbounded. ``SilenceWatch`` times it
    (``register``/``unregister``).

    Liveness: ``node`` is asked every ``period`` seconds of silence (``inf``:
    never); an attempt before commit has a ``head_period`` until its head
    came (``head_seen``, set by the wire). ``ended_by`` says why the watch
    cancelled the scope for the node's silence towards the questions (the
    node did not answer, or is down); ``checks`` counts the passed checks
    this wait asked for.

    The notes that most waits never change are class attributes, set on the
    instance only when they change: one request's timer costs a few stores.
    """

    waiting_since: float | None = None
    silence = 0.0
    stopped = False
    # Whether a SilenceWatch heap holds it; None: the watch has not looked at it yet.
    queued: bool | None = None
    asking = False  # a question of it waits for the node's check
    last_question = -math.inf  # when it last asked
    checks = 0
    ended_by: str | None = None
    resends = 0  # the wire's: requests sent again on a fresh connection

    def __init__(
        self,
        timeout: float,
        *,
        armed: bool,
        node: str = "",
        period: float = math.inf,
        head_period: float | None = None,
        committed: bool = True,
        deadlines: tuple[float, float] = (math.inf, math.inf),
    ) -> None:
        self.timeout = timeout
        self.armed = armed
        self.scope = trio.CancelScope()
        self.node = node
        self.period = period
        if head_period is None:
            self.head_period, self.head_seen = period, True
        else:
            self.head_period, self.head_seen = head_period, False
        self.committed = committed
        # Seconds from the silence's start to the wire's deadline, before and
        # after the head: a question then would come too late to matter.
        self.deadlines = deadlines

    @property
    def fired(self) -> bool:
        """Whether the timer ended the wait (the idle timeout, or the node's silence)."""
        return self.scope.cancel_called

    @property
    def asks_every(self) -> float:
        """The seconds of silence between two questions now."""
        return self.period if self.head_seen else self.head_period

    def expiry(self, now: float) -> float | None:
        """When the idle silence reaches the timeout at the earliest; None: it has, now."""
        since = self.waiting_since
        if not self.armed or since is None:
            # No progress yet, or the relay is writing: the silence cannot
            # end sooner than a whole (remaining) timeout from now.
            return now + (self.timeout - (self.silence if self.armed else 0.0))
        expiry = since + (self.timeout - self.silence)
        return None if now >= expiry else expiry

    def question_due(self, now: float) -> float:
        """When this wait next asks about its node (``inf``: never); at or before ``now``: now."""
        period = self.asks_every
        if period == math.inf:
            return math.inf
        since = self.waiting_since
        if since is None:  # not waiting for the node now: look again a period on
            return now + period
        question = next_question(since, self.last_question, period)
        deadline = since + self.deadlines[self.head_seen]
        return question if question < deadline else math.inf

    def look_at(self, now: float) -> float:
        """When the watch must look at this wait's questions next (``inf``: never).

        Before its head, a wait may start asking more often once the head
        comes (the first body byte's period): the wire cannot move the
        heap, so the watch looks again within that shorter period anyway.
        """
        due = self.question_due(now)
        if self.head_seen or self.period >= self.head_period:
            return due
        since = self.waiting_since
        return min(due, (now if since is None else since) + self.period)


# Below this many stopped entries the heap is not rebuilt: they leave it
# at their expiry anyway, within one timeout.
_COMPACT_MIN = 64


class SilenceWatch:
    """Every wait's ``SilenceTimer`` of a proxy, timed by one task.

    ``watch`` is that task: the proxy runs it for its lifetime
    (``Proxy.run``). A wait ``register``s its timer before it begins and
    ``unregister``s it after, each O(1): a dictionary entry. A wait that has
    not started its silence yet (the relay's and the attempt's, as they
    register) cannot need a look before ``_lead`` seconds from now: its
    shortest timeout or period. The watch scans the waits it has not looked
    at yet every ``_lead`` (a wait with a shorter one wakes it) and puts them
    in its heap, computing their due moments then, as they would have been at
    registration: until a wait's first due moment, its notes alone decide
    it. The relay does no heap work per chunk, and a short wait none at all.
    A stopped timer stays in the heap until its entry comes due or the
    stopped entries are the majority, when the heap is rebuilt without them.

    ``ask``: called with a node's name when a wait's question is due (the
    proxy's ``LivenessChecker.ask``); it answers through ``answered``.
    ``config``: read for ``--liveness-interval`` (what counts as proof of
    life), at use: the proxy's one ``LiveConfig``.
    """

    __slots__ = (
        "_heap",
        "_last_byte",
        "_lead",
        "_next_scan",
        "_seq",
        "_settings",
        "_stale",
        "_timers",
        "_wake",
        "ask",
        "down_because",
        "running",
    )

    def __init__(
        self, config: Config | LiveConfig | None = None, *, ask: Callable[[str], None] | None = None
    ) -> None:
        self._heap: list[tuple[float, int, SilenceTimer]] = []
        self._seq = itertools.count()  # ties in expiry never compare timers
        self._stale = 0  # stopped timers still in the heap
        self._wake = trio.Event()  # set when the watch must look before it meant to
        self.running = False
        self.ask = ask
        # Why a node is down now, None while it is not (the proxy's board): a
        # committed stream silent a period at a down node ends, unasked.
        self.down_because: Callable[[str], str | None] | None = None
        self._settings = None if config is None else live_config(config)
        # Every registered wait, in the order of registration.
        self._timers: dict[SilenceTimer, None] = {}
        # The scans of new waits: every _lead seconds, the next at _next_scan.
        self._lead = self._next_scan = math.inf
        # When each node's last ended stream last relayed.
        self._last_byte: dict[str, float] = {}

    @property
    def interval(self) -> float:
        """``--liveness-interval`` as configured now (0 without a configuration)."""
        return self._settings.config.liveness_interval if self._settings is not None else 0.0

    @property
    def timed(self) -> int:
        """How many waits it times now."""
        return len(self._timers)

    def register(self, timer: SilenceTimer) -> None:
        """Time ``timer`` from now on, until ``unregister``."""
        self._timers[timer] = None
        if timer.waiting_since is None and not timer.silence:
            # Its silence starts from now at the earliest: the watch need not
            # look before ``lead`` (its scan then computes the due moment).
            lead = min(timer.timeout, timer.period, timer.head_period)
            if lead < self._lead:
                self._lead = lead
                self._wake.set()
            return
        # Notes set already (a wait begun before it registered): timed from now.
        now = trio.current_time()
        due = self._due(timer, now)
        if due is None:  # an armed relay waiting past its timeout already
            timer.queued = False
            timer.scope.cancel()
        elif due < math.inf:
            self._push(due, timer)
        else:
            timer.queued = False

    def unregister(self, timer: SilenceTimer) -> None:
        """Stop timing ``timer`` (its wait ended, whichever way)."""
        timer.stopped = True
        self._timers.pop(timer, None)
        if timer.committed and timer.node:
            since = timer.waiting_since
            self._last_byte[timer.node] = trio.current_time() if since is None else since
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

    def _waits_at(self, node: str) -> list[SilenceTimer]:
        """The registered waits on ``node`` (a scan: a check's answer, a node down)."""
        return [timer for timer in self._timers if timer.node == node]

    # -- what the checks and the board tell ---------------------------------

    def moving(self, node: str, now: float) -> bool:
        """Whether a stream of ``node`` relayed a body byte within the proof window.

        A stream that moves proves its node alive; one that stopped proves
        nothing (discovery's timed-out check counts then).
        """
        window = proof_window(self.interval)
        if now - self._last_byte.get(node, -math.inf) < window:
            return True
        return any(
            moving(timer.waiting_since, now, window)
            for timer in self._waits_at(node)
            if timer.committed
        )

    def answered(self, node: str, passed: bool, detail: str) -> None:
        """A check of ``node`` ended: counted by the waits that asked; a failed one ends them."""
        for timer in self._waits_at(node):
            if timer.asking:
                timer.asking = False
                timer.checks += 1
        if not passed:
            self._end_waits(node, detail)

    def board_changed(self, change: object) -> None:
        """The board's listener: a node marked down ends every wait on it (``_end_waits``)."""
        if (
            isinstance(change, NodeChange)
            and change.kind is ChangeKind.DOWN
            and change.model is None
        ):
            detail = f"node down ({change.reason})"
            if change.error:
                detail += f": {change.error}"
            self._end_waits(change.node, detail)

    def _end_waits(self, node: str, detail: str) -> None:
        """End every wait on ``node`` before commit, and its committed streams that are silent."""
        now = trio.current_time()
        window = proof_window(self.interval)
        for timer in self._waits_at(node):
            if timer.scope.cancel_called:
                continue
            if timer.committed and moving(timer.waiting_since, now, window):
                continue  # bytes within the window: alive, whatever a check said
            timer.ended_by = detail
            timer.scope.cancel()

    # -- the heap --------------------------------------------------------------

    def _due(self, timer: SilenceTimer, now: float) -> float | None:
        """The earliest moment ``timer`` needs a look: idle expiry or question; None: expired."""
        question = timer.look_at(now)
        if timer.timeout == math.inf:
            return question
        expiry = timer.expiry(now)
        return None if expiry is None else min(expiry, question)

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
        """End each wait whose node went silent too long; runs until cancelled."""
        if self.running:
            raise RuntimeError("SilenceWatch.watch is already running")
        self.running = True
        try:
            while True:
                woken = self._wake.is_set()
                if woken:
                    self._wake = trio.Event()
                now = trio.current_time()
                if woken or now >= self._next_scan:
                    self._scan(now)
                wake_at = min(self._heap[0][0] if self._heap else math.inf, self._next_scan)
                if wake_at == math.inf:
                    await self._wake.wait()
                    continue
                with trio.move_on_at(wake_at):
                    await self._wake.wait()
                now = trio.current_time()
                if now >= self._next_scan:
                    self._scan(now)
                self._expire(now)
        finally:
            # The waits still registered lose their timing; serve() stops
            # the proxy only after its connections (or when all is cancelled).
            self.running = False

    def _scan(self, now: float) -> None:
        """Put the waits registered since the last scan in the heap, each by its due moment.

        None of them can be due before ``now``: each registered at most
        ``_lead`` ago, before its silence began. No new wait: the scans stop
        until one registers.
        """
        found = False
        for timer in self._timers:
            if timer.queued is not None:
                continue
            found = True
            due = self._due(timer, now)
            if due is None:
                timer.queued = False
                timer.scope.cancel()
            elif due < math.inf:
                heapq.heappush(self._heap, (due, next(self._seq), timer))
                timer.queued = True
            else:
                timer.queued = False
        if found:
            self._next_scan = now + self._lead
        else:
            self._lead = self._next_scan = math.inf

    def _expire(self, now: float) -> None:
        """Look at every entry due by ``now``: fire, ask, push again later, or drop."""
        heap = self._heap
        later: list[tuple[float, SilenceTimer]] = []
        asked: set[str] = set()
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            timer.queued = False
            if timer.stopped:
                self._stale -= 1
                continue
            if timer.scope.cancel_called:  # ended (a down node, its timeout): asks nothing more
                continue
            if timer.timeout != math.inf and timer.expiry(now) is None:
                timer.scope.cancel()
                continue
            question = timer.question_due(now)
            if question <= now:
                down = None
                if timer.committed and self.down_because is not None:
                    down = self.down_because(timer.node)
                if down is not None:  # marked down while its last bytes still came
                    timer.ended_by = f"node down ({down})"
                    timer.scope.cancel()
                    continue
                timer.asking, timer.last_question = True, question
                asked.add(timer.node)
            due = self._due(timer, now)
            if due is None:
                timer.scope.cancel()
            elif due < math.inf:  # pushed after the loop: each timer is looked at once per pass
                later.append((due, timer))
        for due, timer in later:  # the watcher's next sleep reads the top itself
            heapq.heappush(heap, (due, next(self._seq), timer))
            timer.queued = True
        if self.ask is not None:
            for node in asked:
                self.ask(node)
