"""Pure: node capacity, the queue of waiting workloads, and load-aware order.

Decide first, then act. Every call here decides synchronously from plain
data (node names, counts, an answer to "is this node ready?") and changes
only this module's own tables; the Trio shell acts afterwards: it opens the
connection of a granted slot and sets the event of each woken waiter. Nothing
here reads a clock, blocks or imports outside the standard library.

Two rules hold throughout:

1. A ready untried candidate always beats a cooling or down one, even when it
   is full (the workload then waits for it). Only when every untried
   candidate is cooling or down are those used, in their resolved order.
2. A slot is taken in the ledger at the moment it is decided, for a newcomer
   as for a woken waiter, so no two workloads are ever handed the same slot;
   a freed slot that some waiter may use is handed on in the same call that
   frees it, so a newcomer never finds a free slot a waiter was owed.

In three parts, in this order: the ledger (``SlotLedger``: each node's
capacity and in-flight count, and the engines' readings of it); the order
of one attempt (``choose_node``: take, wait, or nothing left; it decides
from the ledger's counts and an answer to "is this node ready?" and takes
nothing); the queue (``SlotScheduler``: takes, queues and hands slots on
by ``choose_node``) and its budget (``QueueBudget``).

One ``SlotScheduler`` per proxy; what the shell does with it, per workload::

    tried: set[str] = set()
    budget = QueueBudget(queue_timeout)
    while True:
        order = [...]          # candidate names, see choose_node()
        result = scheduler.acquire(trio.Event(), order, tried=tried,
                                   ready=is_ready, preferred=preferred)
        if isinstance(result, Exhausted): ...      # all tried: 502/504 as today
        if isinstance(result, QueueFull): ...      # 503 queue_full at once
        if isinstance(result, Queued):
            waiter, started = result.waiter, trio.current_time()
            try:
                with trio.move_on_at(budget.deadline(started)):
                    await waiter.token.wait()
            except BaseException:              # client left, shutdown
                wake(scheduler.leave(waiter, ready=is_ready))
                raise
            budget = budget.spent(started, trio.current_time())
            if waiter.slot is None:            # the budget ran out
                wake(scheduler.leave(waiter, ready=is_ready))
                ...                            # 503 queue_timeout
            slot = waiter.slot
        else:
            slot = result.slot
        try:
            ...                                # the attempt at slot.node
        finally:
            wake(scheduler.release(slot, ready=is_ready))
        tried.add(slot.node)

where ``wake(handoffs)`` is ``for h in handoffs: h.waiter.token.set()``. The
shell also calls ``scheduler.dispatch(ready=...)`` whenever a node changes
between ready, cooling and down (a cooldown starting or ending, a health
check), because that can change which waiters may use which nodes. A
cooldown ends lazily, by expiry, with no event of its own: while the queue
is not empty, the shell must wake at the earliest cooldown end and dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from itertools import count
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeAlias, TypeVar

from .sharing import ANONYMOUS, NORMAL, PRIORITIES, ClientUse, ShareBook

__all__ = [
    "BALANCE_MODES",
    "Acquired",
    "Balance",
    "EngineLoad",
    "Exhausted",
    "Granted",
    "Handoff",
    "NodeFull",
    "QueueBudget",
    "QueueFull",
    "Queued",
    "Readiness",
    "Slot",
    "SlotLedger",
    "SlotScheduler",
    "Take",
    "Wait",
    "Waiter",
    "as_predicate",
    "choose_node",
]

T = TypeVar("T")

# The one definition of --balance's modes (``core.config`` takes them from here).
Balance = Literal["priority", "least-loaded"]
BALANCE_MODES: tuple[Balance, ...] = ("priority", "least-loaded")

Readiness: TypeAlias = Callable[[str], bool] | AbstractSet[str]
"""Which nodes are ready now: a predicate on the name, or the set of ready names."""


class EngineLoad(Protocol):
    """What the ledger reads of an engine's signal (``engines.Signals`` is one).

    Attributes:
        busy: requests the engine works on now, whoever sent them; None = unknown.
        waiting: requests queued inside the engine; None = unknown.
    """

    @property
    def busy(self) -> int | None: ...

    @property
    def waiting(self) -> int | None: ...


class NodeFull(RuntimeError):
    """``SlotLedger.take`` on a node that has no free slot."""

    def __init__(self, node: str) -> None:
        super().__init__(f"node {node!r} is full")
        self.node = node


# -- the ledger ------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Slot:
    """One attempt's hold on one node, from connect to the end of its relay.

    Release it exactly once, in ``finally``; a second release is a no-op
    (``SlotLedger.release`` returns False), so releasing early before a
    failover and again in ``finally`` is safe.
    """

    node: str
    ledger: SlotLedger = field(repr=False)
    released: bool = False
    client: str | None = None
    """The client whose attempt holds it (``SlotScheduler``); None: taken by the ledger alone."""


class SlotLedger:
    """Capacity and in-flight count per node; take and release in O(1).

    Counts this proxy's attempts; the engines' own counts (work of other
    clients and proxies, docs/engines.md) come in through ``signals``, a
    mapping of node name -> ``Signals`` that its owner keeps current (fresh
    readings only: a stale one is removed, never left to limit). With it empty, as
    by default, every answer is the proxy's own count alone, at no extra
    cost. Every name passed in must be one of ``capacities`` (``KeyError``
    otherwise).

    A reading is a snapshot: the engine's busy count includes this proxy's
    own attempts of that moment. The owner calls ``note_reading`` when it
    stores a fresh one, and from then on the engine's count is moved by
    this proxy's own takes and releases (``engine_busy``), so a slot this
    proxy frees is free at once, not one load interval later.
    """

    def __init__(
        self, capacities: Mapping[str, int], signals: Mapping[str, EngineLoad] | None = None
    ) -> None:
        """Check and copy the capacities.

        Args:
            capacities: node name -> most attempts in flight, ``0`` = no limit.
            signals: the engines' readings by node (kept, not copied: its
                owner updates it in place); None = none.
        """
        for node, capacity in capacities.items():
            _check_capacity(node, capacity)
        self._capacity = dict(capacities)
        self._in_flight = dict.fromkeys(capacities, 0)
        self.signals: Mapping[str, EngineLoad] = {} if signals is None else signals
        # Nodes a reload removed: full for good, kept while their running
        # attempts release their slots (their counts stay exact).
        self._retired: set[str] = set()
        # node -> this proxy's in-flight count when its reading was taken.
        self._at_reading: dict[str, int] = {}
        # Nodes full across the replicas: the shared state refused
        # a slot there, until a freed one is announced. Empty without one.
        self.elsewhere: set[str] = set()
        # node -> the other replicas' attempts there, as they last told
        # (``fair_share.py``): counted in ``load`` and ``fleet_in_flight``,
        # never in ``is_full`` (the slot take in Redis decides that). Empty without one.
        self.in_flight_elsewhere: dict[str, int] = {}

    def note_reading(self, node: str) -> None:
        """``node``'s reading in ``signals`` was just taken: anchor it to the count now."""
        self._at_reading[node] = self._in_flight[node]

    def ended_elsewhere(self, node: str) -> bool:
        """Another replica's attempt at ``node`` ended: one fewer busy in the reading.

        The engine's count holds the other replicas' attempts among its
        "others"; the freed slot is announced at once, the engine's next
        reading comes up to a load interval later. Never below this
        proxy's own count; a reading that holds no others is left alone.
        Returns whether the count moved.
        """
        reading = self.signals.get(node) if self.signals else None
        if reading is None or reading.busy is None:
            return False
        anchor = self._at_reading.get(node, self._in_flight[node])
        if reading.busy - anchor <= 0:
            return False
        self._at_reading[node] = anchor + 1
        return True

    def engine_busy(self, node: str) -> int | None:
        """The engine's busy count now, by its last reading; None = it says none.

        The reading's work of others, ``max(busy - in_flight_then, 0)``,
        plus this proxy's attempts now. At the moment of the reading that
        is ``max(in_flight, busy)``; without ``note_reading`` it
        stays exactly that.
        """
        reading = self.signals.get(node) if self.signals else None
        if reading is None or reading.busy is None:
            return None
        in_flight = self._in_flight[node]
        others = reading.busy - self._at_reading.get(node, in_flight)
        return in_flight + others if others > 0 else in_flight

    def full_by_others(self, node: str) -> bool:
        """Whether the engine's count fills ``node`` with work besides this proxy's.

        Another replica whose waiters wait for such a node asks Redis
        nothing (its ledger sees the node full): it hears of a slot only
        when one is announced freed, or at the engine's next reading.
        False without a capacity or a busy count.
        """
        capacity = self._capacity[node]
        if capacity <= 0:
            return False
        busy = self.engine_busy(node)
        return busy is not None and busy >= capacity and busy > self._in_flight[node]

    def set_capacity(self, node: str, capacity: int) -> bool:
        """Change one node's capacity (capacity ``auto`` resolved anew); True if it changed.

        Attempts in flight keep their slots; a lower capacity makes the node
        full until enough end. A higher one can let waiters on: the caller
        dispatches the queue then.
        """
        _check_capacity(node, capacity)
        if node not in self._capacity:
            raise KeyError(node)
        changed = self._capacity[node] != capacity
        self._capacity[node] = capacity
        return changed

    def reconfigure(self, capacities: Mapping[str, int]) -> None:
        """Take a reload's nodes and capacities; in-flight counts are kept.

        A node not in ``capacities`` is retired: it counts as full (no new
        slot) and keeps its count for the slots still held there. A lowered
        capacity lets no new slot in until the count is below it.
        """
        checked = SlotLedger(capacities)
        self._retired = (set(self._capacity) | self._retired) - set(checked._capacity)
        for node in self._retired:
            self._capacity[node] = self._capacity.get(node, 0)
        for node, capacity in checked._capacity.items():
            self._capacity[node] = capacity
            self._in_flight.setdefault(node, 0)
        order = [*checked._capacity, *(node for node in self._capacity if node in self._retired)]
        self._capacity = {node: self._capacity[node] for node in order}

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes, in the order they were given (retired ones left out)."""
        return tuple(node for node in self._capacity if node not in self._retired)

    def capacity(self, node: str) -> int:
        """The node's capacity (``0`` = no limit)."""
        return self._capacity[node]

    def in_flight(self, node: str) -> int:
        """This proxy's attempts holding a slot at ``node`` now."""
        return self._in_flight[node]

    def fleet_in_flight(self, node: str) -> int:
        """The attempts at ``node`` of this proxy and of the other replicas (as they told)."""
        elsewhere = self.in_flight_elsewhere
        return self._in_flight[node] + (elsewhere.get(node, 0) if elsewhere else 0)

    def is_full(self, node: str) -> bool:
        """Whether ``node`` is at its capacity; never true with capacity 0.

        Full by this proxy's count, or by the engine's own busy count where
        ``signals`` has one (``engine_busy``: as read, moved by this proxy's
        takes and releases since).
        """
        capacity = self._capacity[node]
        if capacity > 0 and self._in_flight[node] >= capacity:
            return True
        if self._retired and node in self._retired:
            return True
        if self.elsewhere and node in self.elsewhere:
            return True
        if capacity <= 0:
            return False
        if not self.signals:  # no engine signal anywhere: the proxy's count alone
            return False
        busy = self.engine_busy(node)
        return busy is not None and busy >= capacity

    def load(self, node: str) -> float:
        """What ``least-loaded`` minimises, and cache affinity's load rule compares.

        ``in_flight / max(capacity, 1)`` without a signal; with one,
        ``(max(in_flight, busy) + waiting) / max(capacity, 1)``, ``busy``
        moved as in ``engine_busy``; ``in_flight`` with the other replicas'
        attempts (``in_flight_elsewhere``). Float division is exact enough for
        ties: two equal ratios of small ints round to the same float, so
        "ties in resolved order" holds.
        """
        reading = self.signals.get(node) if self.signals else None
        in_flight = self._in_flight[node]
        if self.in_flight_elsewhere:  # replicas: theirs too
            in_flight += self.in_flight_elsewhere.get(node, 0)
        if reading is None:
            return in_flight / max(self._capacity[node], 1)
        busy = self.engine_busy(node)
        if busy is not None and busy > in_flight:
            in_flight = busy
        return (in_flight + (reading.waiting or 0)) / max(self._capacity[node], 1)

    def take(self, node: str) -> Slot:
        """Hold one slot at ``node``.

        Raises:
            NodeFull: the node is at its capacity.
        """
        if self.is_full(node):
            raise NodeFull(node)
        self._in_flight[node] += 1
        return Slot(node, self)

    def take_free(self, node: str, client: str) -> Slot:
        """Hold one slot at ``node``, known to have room, for ``client``'s attempt.

        For a node that ``choose_node`` has just answered ``Take`` with and
        nothing taken since: ``take`` without asking ``is_full`` again.
        """
        self._in_flight[node] += 1
        return Slot(node, self, False, client)

    def release(self, slot: Slot) -> bool:
        """Give ``slot`` back. Returns False if it was already released.

        Raises:
            ValueError: the slot comes from another ledger.
        """
        if slot.ledger is not self:
            raise ValueError("slot belongs to another ledger")
        if slot.released:
            return False
        slot.released = True
        self._in_flight[slot.node] -= 1
        return True


def _check_capacity(node: str, capacity: object) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity of {node!r} must be an int >= 0, not {capacity!r}")


# -- the order of one attempt ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Take:
    """Take a slot at ``node`` now."""

    node: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Every node this workload may use now is full: ``nodes``, in order."""

    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Exhausted:
    """No untried candidate is left."""


Choice: TypeAlias = Take | Wait | Exhausted


def choose_node(
    order: Sequence[str],
    *,
    tried: AbstractSet[str],
    ready: Readiness,
    ledger: SlotLedger,
    balance: Balance = "priority",
    preferred: str | None = None,
    loaded: AbstractSet[str] = frozenset(),
) -> Choice:
    """Where the next attempt of one workload goes, or why it cannot go now.

    The untried candidates are split, stably, into those ready now and the
    rest (cooling or down). If any is ready, only the ready ones count: the
    first that is not full by ``balance``, else ``Wait`` for them. Otherwise
    the rest count, in ``order`` whatever ``balance`` says (an
    all-cooling fleet is used in ranking order), else ``Wait`` for them.
    ``preferred`` goes first while it has a free slot and is in the group
    that counts; when it is full the next free node is taken (availability
    beats cache reuse). With capacity 0 everywhere and ``priority`` the
    answer is the first untried candidate of today's order, never ``Wait``.

    Args:
        order: the workload's candidate names in resolved order (model
            filter, affinity and selection applied:
            ``ranking.resolve_candidates``), not partitioned by readiness:
            that is done here, one question per node, so a node that
            recovers while a workload waits regains its place, as in a
            fresh resolution. Names are unique and known to ``ledger``.
        tried: the nodes this workload has already tried.
        ready: which nodes are ready now.
        ledger: capacities and in-flight counts.
        balance: ``priority`` = resolved order among the free ready nodes;
            ``least-loaded`` = lowest ``ledger.load()``, ties in resolved order.
        preferred: the node resolution moved to the front (``X-Failover-Node``,
            else the prefix-affinity winner), or None. ``priority`` alone
            would find it first anyway; ``least-loaded`` needs to be told.
        loaded: the nodes whose engine holds the request's model loaded now
            (Ollama and LM Studio; ``engines.model_loaded``). Among
            the ready nodes that are not full, these come first: when any
            of them is free, the choice (``preferred``, then ``balance``)
            is made among them alone. Empty (the default): as without it.

    Returns:
        ``Take(node)``, ``Wait(nodes)`` or ``Exhausted()``. Nothing is taken:
        ``SlotScheduler.acquire`` does that.
    """
    is_ready = as_predicate(ready)
    ready_group: list[str] = []
    other_group: list[str] = []
    for node in order:
        if node not in tried:
            (ready_group if is_ready(node) else other_group).append(node)
    if ready_group:
        return _pick(ready_group, ledger, balance, preferred, loaded)
    if other_group:
        return _pick(other_group, ledger, "priority", preferred, frozenset())
    return Exhausted()


def _pick(
    group: list[str],
    ledger: SlotLedger,
    balance: Balance,
    preferred: str | None,
    loaded: AbstractSet[str],
) -> Choice:
    free = [node for node in group if not ledger.is_full(node)]
    if not free:
        return Wait(tuple(group))
    if loaded:
        warm = [node for node in free if node in loaded]
        free = warm or free
    if preferred is not None and preferred in free:
        return Take(preferred)
    if balance == "priority":
        return Take(free[0])
    return Take(min(free, key=ledger.load))  # min() keeps the first of equals


def as_predicate(ready: Readiness) -> Callable[[str], bool]:
    """``ready`` as a predicate on the node name."""
    if callable(ready):
        return ready
    return ready.__contains__


def _asked_once(ready: Readiness) -> Callable[[str], bool]:
    # One decision over many waiters must see one answer per node: a
    # predicate reading a cooldown at "now" could flip between two waiters.
    ask = as_predicate(ready)
    answers: dict[str, bool] = {}

    def is_ready(node: str) -> bool:
        answer = answers.get(node)
        if answer is None:
            answer = answers[node] = ask(node)
        return answer

    return is_ready


# A node's readiness for one model (per-model cooldowns): model -> predicate.
ReadyFor: TypeAlias = Callable[[str], Readiness]


def _model_ready(
    by_model: dict[str, Callable[[str], bool]], model: str, ready_for: ReadyFor
) -> Callable[[str], bool]:
    found = by_model.get(model)
    if found is None:
        found = by_model[model] = _asked_once(ready_for(model))
    return found


# -- the queue -------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One workload waiting for a slot (identity, not value, is its key).

    Attributes:
        token: what the shell passed to ``acquire`` (e.g. its ``trio.Event``).
        order, tried, preferred, loaded: as passed to ``acquire``, frozen.
        model: the model it asks for, set by the shell as it queues: a
            hand-off asks ``ready_for(model)`` of it (per-model cooldowns).
        position: its place when it started waiting, 1 = next (the
            ``position`` of its ``queued`` event).
        slot: set when a hand-off gives it a slot (taken for it already).
    """

    token: T
    order: tuple[str, ...]
    tried: frozenset[str]
    preferred: str | None
    position: int
    untried: frozenset[str] = field(repr=False)
    slot: Slot | None = None
    loaded: frozenset[str] = frozenset()
    model: str | None = None
    moved: bool = False
    """Set when a reload took it out of the queue: resolve its candidates again."""
    client: str = ANONYMOUS
    """Its client: fair share picks among the clients, ``max_in_flight`` holds per client."""
    rank: int = NORMAL
    """Its priority's rank (``sharing.PRIORITIES``: 0 = high)."""
    seq: int = 0
    """Its arrival number: the newest of a priority is the one a full queue displaces."""
    displaced: bool = False
    """Set when a newcomer of a higher priority took its place in a full queue."""


class Handoff(NamedTuple, Generic[T]):
    """``waiter`` now holds ``slot``: the shell wakes it (``waiter.slot`` is set too)."""

    waiter: Waiter[T]
    slot: Slot


# ``Handoff(waiter, slot)`` ends in ``tuple.__new__(Handoff, (waiter, slot))``:
# called directly, at half the cost of the class call (the fair hand-off's).
_new_tuple = tuple.__new__


@dataclass(frozen=True, slots=True)
class Granted:
    """A slot is taken for the workload: attempt ``slot.node`` now."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class Queued(Generic[T]):
    """The workload waits as ``waiter``; a hand-off will set ``waiter.slot``.

    ``displaced``: the waiter of a lower priority whose place it took in a
    full queue; it is out of the queue, ``displaced`` set: wake it (``503``).
    """

    waiter: Waiter[T]
    displaced: Waiter[T] | None = None


@dataclass(frozen=True, slots=True)
class QueueFull:
    """The queue is at max-queue: answer ``503`` ``queue_full`` at once."""


Acquired: TypeAlias = Granted | Queued[T] | QueueFull | Exhausted


class SlotScheduler(Generic[T]):
    """The ledger and the queue of one proxy, deciding together.

    The queue is fair (``fair``, the default): a freed slot goes to the
    waiter of the highest priority, then of the client with the lowest
    recent use divided by its weight (``sharing.ShareBook``; a client with
    nothing running before every client with work running; with replicas,
    both fleet-wide: ``told_elsewhere``), then the longest-waiting. Not
    fair: the longest-waiting, first come first served.
    Either way a client at its ``max_in_flight`` takes no further slot.

    Costs: ``acquire`` is O(candidates); ``release`` with an empty queue,
    or of a node that was not full, is O(1) and never asks ``ready``;
    ``leave`` of a waiting workload is O(1). A FIFO hand-off scans the
    waiters in arrival order and stops as soon as the freed node is full
    again; a fair one takes the idle client of least use from a heap (one
    FIFO per priority and client), then that client's waiters, and scans
    the clients only when no idle one may take the slot.
    """

    def __init__(
        self,
        capacities: Mapping[str, int],
        *,
        balance: Balance = "priority",
        max_queue: int = 0,
        signals: Mapping[str, EngineLoad] | None = None,
        fair: bool = True,
    ) -> None:
        """An empty queue and a ledger with nothing in flight.

        Args:
            capacities: node name -> capacity, ``0`` = no limit.
            signals: the engines' readings by node, for the ledger
                (``SlotLedger``); None = none.
            balance: ``priority`` or ``least-loaded``.
            max_queue: most workloads waiting at once, ``0`` = no limit.
            fair: fair share among the clients; False = first come, first served.

        Raises:
            ValueError: a bad capacity, balance or max_queue.
        """
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, not {balance!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, not {max_queue!r}")
        self.ledger = SlotLedger(capacities, signals)
        # A waiter with a ``model`` is handed off by ``ready_for(model)``
        # (per-model cooldowns); None: by ``ready`` alone.
        self.ready_for: ReadyFor | None = None
        self.balance: Balance = balance
        self.max_queue = max_queue
        self.fair = fair
        # Each client's use, weight and attempts running (``configure`` sets
        # the weights and limits of the configured clients).
        self.shares = ShareBook()
        # An insertion-ordered dict is the FIFO: arrival order to iterate,
        # O(1) removal from the middle when a waiter leaves.
        self._waiters: dict[Waiter[T], None] = {}
        # The same waiters by priority rank (highest first), then client,
        # each in arrival order: fair share scans the clients, not every waiter.
        self._lanes: dict[int, dict[str, _Lane[T]]] = {}
        # Per priority, the lanes of clients with nothing running (here or
        # at the other replicas), by fleet-wide use ÷ weight (which stays
        # put while a client runs nothing, until the other replicas' figures
        # change: then pushed again): the fair pick finds the best of them
        # without a scan. Entries go stale (checked when they come up), and
        # all at once when the book's epoch moves or the weights change
        # (then rebuilt).
        self._idle: dict[int, list[tuple[float, int, _Lane[T]]]] = {}
        self._idle_epoch: float | None = None
        # Ties of use ÷ weight go in the order pushed.
        self._pushes = count()
        self._arrivals = 0
        self._releases = 0

    def __len__(self) -> int:
        """Workloads waiting now (``queued`` of ``/status``)."""
        return len(self._waiters)

    def waiting(self) -> list[Waiter[T]]:
        """The waiting workloads, longest-waiting first (a copy)."""
        return list(self._waiters)

    def acquire(
        self,
        token: T,
        order: Sequence[str],
        *,
        tried: Iterable[str] = (),
        ready: Readiness,
        preferred: str | None = None,
        loaded: AbstractSet[str] = frozenset(),
        client: str = ANONYMOUS,
        rank: int = NORMAL,
        now: float = 0.0,
    ) -> Acquired[T]:
        """Decide and reserve the next attempt of one workload.

        Args: as ``choose_node``; ``token`` is kept on the waiter if it
            waits; ``client`` and ``rank`` (its priority) place it in the
            queue; ``now`` times its client's use of the slot it takes.

        Returns:
            ``Granted(slot)``: the slot is taken, attempt its node.
            ``Queued(waiter)``: all it may use is full, or its client runs
            its ``max_in_flight``; it waits at ``waiter.position`` (and may
            have displaced a waiter of a lower priority from a full queue).
            ``QueueFull()``: it would make the queue longer than
            ``max_queue`` and displaces no one. ``Exhausted()``: nothing
            untried left.
        """
        tried = frozenset(tried)
        choice = choose_node(
            order,
            tried=tried,
            ready=ready,
            ledger=self.ledger,
            balance=self.balance,
            preferred=preferred,
            loaded=loaded,
        )
        if isinstance(choice, Exhausted):
            return choice
        if isinstance(choice, Take) and not self.shares.at_limit(client):
            return Granted(self._take(choice.node, client, now))
        displaced = None
        if self.max_queue and len(self._waiters) >= self.max_queue:
            displaced = self._displace(rank)
            if displaced is None:
                return QueueFull()
        self._arrivals += 1
        waiter = Waiter(
            token=token,
            order=tuple(order),
            tried=tried,
            preferred=preferred,
            position=self._place(client, rank, now),
            untried=frozenset(order) - tried,
            loaded=frozenset(loaded),
            client=client,
            rank=rank,
            seq=self._arrivals,
        )
        self._waiters[waiter] = None
        lanes = self._lanes.get(rank)
        if lanes is None:  # a priority new to the queue: kept in rank order
            lanes = self._lanes[rank] = {}
            self._lanes = dict(sorted(self._lanes.items()))
        lane = lanes.get(client)
        if lane is None:
            lane = lanes[client] = _Lane(self.shares.client(client))
            if self.fair and not lane.use.running and not lane.use.elsewhere:
                self._push_idle(rank, lane)
        lane.waiters[waiter] = None
        return Queued(waiter, displaced)

    def release(self, slot: Slot, *, ready: Readiness, now: float = 0.0) -> list[Handoff[T]]:
        """Give ``slot`` back (again: no-op) and hand the freed slot on.

        ``now`` ends its client's use of it.

        Returns:
            The waiters that now hold a slot, to wake (one, as a rule).
        """
        node, client = slot.node, slot.client
        was_full = self.ledger.is_full(node)
        if not self.ledger.release(slot):
            return []
        limited = False
        if client is not None:
            limited = self.shares.at_limit(client)
            self.shares.released(client, now)
            use = self.shares.clients[client]
            if self.fair and not use.running and not use.elsewhere:
                # Idle now: its lanes' keys stay put until it runs again.
                # _push_idle_lanes, inline: this runs at nearly every hand-off.
                for rank, lanes in self._lanes.items():
                    lane = lanes.get(client)
                    if lane is None:
                        continue
                    heap = self._idle.get(rank)  # (a rebuild replaces them all)
                    order = next(self._pushes)
                    # Whether stale entries pile up: asked once in 64 pushes.
                    if heap is None or (not order % 64 and len(heap) > 2 * len(lanes) + 64):
                        self._push_idle(rank, lane)  # the same, or a rebuild first
                    else:
                        held = lane.use
                        key = (held.scaled + held.scaled_elsewhere) / held.weight
                        heappush(heap, (key, order, lane))
            self._releases += 1
            if not self._releases % FORGET_EVERY:
                self.shares.forget(now, self._waiting_clients())
        if not self._waiters:
            return []
        handoffs: list[Handoff[T]] = []
        if was_full:
            handoffs = self._hand_off(_asked_once(ready), node, now)
        if limited and client is not None:
            # Its waiters may wait for this, with free slots about.
            handoffs += self._hand_off(_asked_once(ready), None, now, only=client)
        # Not full before, and no client's limit lifted: no waiter was
        # waiting for this (rule 2), so nobody's options changed. The hot path.
        return handoffs

    def leave(self, waiter: Waiter[T], *, ready: Readiness, now: float = 0.0) -> list[Handoff[T]]:
        """The workload gives up (client gone, timeout, shutdown, error).

        Removes it from the queue if it still waits (O(1)). If a hand-off
        already gave it a slot it will not use, that slot is released and
        handed on. Call it only when the workload will not use the slot;
        a second call is a no-op.
        """
        if waiter in self._waiters:
            self._remove(waiter)
            return []
        if waiter.slot is None:  # left already
            return []
        return self.release(waiter.slot, ready=ready, now=now)

    def dispatch(self, *, ready: Readiness, now: float = 0.0) -> list[Handoff[T]]:
        """Hand out what the waiters may use now, after a node changed state.

        A node turning cooling can let a waiter use a cooling node that is
        free (when none of its untried candidates stays ready); a node
        turning ready can give a waiter a free node it could not use.
        O(waiters x candidates): call it on state changes, not per request.
        """
        if not self._waiters:
            return []
        return self._hand_off(_asked_once(ready), None, now)

    def told_elsewhere(self, told: Iterable[tuple[float, str, int, float]], now: float) -> bool:
        """The other replicas' running attempts and use by client (``ShareBook.told_elsewhere``).

        They join each client's own in the fair order (its use is
        fleet-wide, and one running only elsewhere is not idle here) and
        toward its ``max_in_flight``. Returns whether a count fell for a
        client with a limit: then ``dispatch``, a waiter at its limit may run.
        """
        changed, fell = self.shares.told_elsewhere(told, now)
        if self.fair and changed and self._lanes:
            clients = self.shares.clients
            for client in changed:
                use = clients.get(client)
                if use is not None and not use.running and not use.elsewhere:
                    self._push_idle_lanes(client)  # idle, at a new key: its old entries go stale
        return fell

    def configure_clients(self, settings: Mapping[str, tuple[float, int]]) -> None:
        """The configured clients' ``(weight, max_in_flight)`` by name (at start and reload)."""
        self.shares.configure(settings)
        self._rebuild_idle()

    def reconfigure(
        self, capacities: Mapping[str, int], *, balance: Balance, max_queue: int, moved: bool
    ) -> list[Waiter[T]]:
        """Take a reload's capacities, balance and queue length.

        ``moved``: the node list changed, so the waiters' candidates are
        stale; they all leave the queue with ``moved`` set, to resolve their
        candidates against the new list (returned, longest-waiting first).
        Otherwise call ``dispatch`` after: a raised capacity may let
        waiters in.
        """
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, not {balance!r}")
        self.ledger.reconfigure(capacities)
        self.balance, self.max_queue = balance, max_queue
        if not moved:
            return []
        waiters = self.drain()
        for waiter in waiters:
            waiter.moved = True
        return waiters

    def drain(self) -> list[Waiter[T]]:
        """Empty the queue (shutdown); the waiters, longest-waiting first."""
        waiters = list(self._waiters)
        self._waiters.clear()
        for lanes in self._lanes.values():
            for lane in lanes.values():
                lane.alive = False
        self._lanes.clear()
        self._idle.clear()
        return waiters

    def use(self, client: str, now: float) -> float:
        """``client``'s recent use of the fleet at ``now``, in decayed slot-seconds."""
        return self.shares.use(client, now)

    def share_summary(self, now: float) -> list[tuple[str, int, int, int, float]]:
        """The clients that wait or run here, for the other replicas (``fleet_share.ClientShare``).

        ``(client, rank, waiting, running, use)`` per priority and client
        with waiters: how many wait, its attempts running and its use at
        ``now``; a client that only runs, once, with nothing waiting (rank
        ``normal``).
        """
        shares, seen = self.shares, set()
        summary: list[tuple[str, int, int, int, float]] = []
        for rank, lanes in sorted(self._lanes.items()):
            for client, lane in lanes.items():
                seen.add(client)
                summary.append(
                    (client, rank, len(lane.waiters), lane.use.running, shares.use(client, now))
                )
        for client, use in shares.clients.items():
            if use.running and client not in seen:
                summary.append((client, NORMAL, 0, use.running, shares.use(client, now)))
        return summary

    def best_waiting(self, now: float) -> tuple[int, str] | None:
        """``(rank, client)`` of the waiter a freed slot would go to first; None: none may take one.

        Fair: the highest priority's client of the lowest use ÷ weight (not
        at its ``max_in_flight``); first come, first served: the
        longest-waiting's. The nodes it may use are not asked.
        """
        shares = self.shares
        if not self.fair:
            for waiter in self._waiters:
                if not shares.at_limit(waiter.client):
                    return waiter.rank, waiter.client
            return None
        unit = shares.scale(shares.factor(now))
        for rank in _RANKS:
            lanes = self._lanes.get(rank)
            if lanes:
                best = _best_client(lanes, unit, frozenset())
                if best is not None:
                    return rank, next(iter(best.waiters)).client
        return None

    # -- inside ----------------------------------------------------------------------

    def _place(self, client: str, rank: int, now: float) -> int:
        """The place a newcomer of ``client`` and ``rank`` takes in the queue now, 1 = next.

        First come, first served: behind every waiter. Fair: behind the
        waiters of the higher priorities, its own client's, and those of
        each client of its priority that goes before its client now, as
        ``_best_client`` ranks them (nothing running before work running,
        then the lower use ÷ weight; a tie to the client that began waiting
        first). The order of a fair queue moves as the clients' use does:
        this is the place as the queue stands when the newcomer joins it.
        """
        if not self.fair:
            return len(self._waiters) + 1
        unit = self.shares.scale(self.shares.factor(now))
        mine = _client_key(self.shares.client(client), unit)
        ahead = 0
        for lane_rank, lanes in self._lanes.items():
            if lane_rank < rank:
                ahead += sum(len(lane.waiters) for lane in lanes.values())
            elif lane_rank == rank:
                tie_goes_first = True  # lanes that began before its client's
                for name, lane in lanes.items():
                    if name == client:
                        tie_goes_first = False
                        ahead += len(lane.waiters)
                        continue
                    theirs = _client_key(lane.use, unit)
                    if theirs < mine or (tie_goes_first and theirs == mine):
                        ahead += len(lane.waiters)
        return ahead + 1

    def _take(self, node: str, client: str, now: float) -> Slot:
        slot = self.ledger.take(node)
        slot.client = client
        self.shares.took(client, now)
        return slot

    def _waiting_clients(self) -> set[str]:
        return {client for lanes in self._lanes.values() for client in lanes}

    def _remove(self, waiter: Waiter[T]) -> None:
        del self._waiters[waiter]
        lanes = self._lanes[waiter.rank]
        lane = lanes[waiter.client]
        del lane.waiters[waiter]
        if not lane.waiters:
            lane.alive = False
            del lanes[waiter.client]

    def _push_idle_lanes(self, client: str) -> None:
        """Push each lane of ``client`` (idle now) onto its priority's heap.

        ``release`` does the same in place (it runs at nearly every hand-off).
        """
        for rank, lanes in self._lanes.items():
            lane = lanes.get(client)
            if lane is not None:
                self._push_idle(rank, lane)

    def _push_idle(self, rank: int, lane: _Lane[T]) -> None:
        heap = self._idle.setdefault(rank, [])
        if len(heap) > 2 * len(self._lanes.get(rank, ())) + 64:
            self._rebuild_idle()  # stale entries pile up: start afresh
            heap = self._idle.setdefault(rank, [])
        use = lane.use
        heappush(heap, ((use.scaled + use.scaled_elsewhere) / use.weight, next(self._pushes), lane))

    def _rebuild_idle(self) -> None:
        self._idle = {}
        self._idle_epoch = self.shares.epoch
        if not self.fair:
            return
        for rank, lanes in self._lanes.items():
            heap = self._idle[rank] = []
            for lane in lanes.values():
                use = lane.use
                if not use.running and not use.elsewhere:
                    key = (use.scaled + use.scaled_elsewhere) / use.weight
                    heap.append((key, next(self._pushes), lane))
            heapify(heap)

    def _best_idle(self, rank: int) -> _Lane[T] | None:
        """The lane of the idle client with the lowest use ÷ weight (its waiters go first).

        Idle: nothing running here nor at the other replicas. An entry is
        current while its lane is alive, its client idle and its key the
        client's key now (the same expression as ``_push_idle``'s, so equal
        to the bit); the others are dropped as they come up.
        """
        if self._idle_epoch != self.shares.epoch:  # every stored sum was scaled
            self._rebuild_idle()
        heap = self._idle.get(rank)
        while heap:
            key, _, lane = heap[0]
            use = lane.use
            if (
                lane.alive
                and not use.running
                and not use.elsewhere
                and key == (use.scaled + use.scaled_elsewhere) / use.weight
            ):
                return lane
            heappop(heap)
        return None

    def _displace(self, rank: int) -> Waiter[T] | None:
        """Room in a full queue for a newcomer of ``rank``: the newest of the lowest below it."""
        for lowest in sorted(self._lanes, reverse=True):
            if lowest <= rank:
                return None
            lanes = self._lanes[lowest]
            if lanes:
                victim = max(
                    (next(reversed(lane.waiters)) for lane in lanes.values()), key=_arrival
                )
                self._remove(victim)
                victim.displaced = True
                return victim
        return None

    def _choose(
        self,
        waiter: Waiter[T],
        is_ready: Callable[[str], bool],
        by_model: dict[str, Callable[[str], bool]],
    ) -> Choice:
        ready_for = self.ready_for
        return choose_node(
            waiter.order,
            tried=waiter.tried,
            ready=is_ready
            if ready_for is None or waiter.model is None
            else _model_ready(by_model, waiter.model, ready_for),
            ledger=self.ledger,
            balance=self.balance,
            preferred=waiter.preferred,
            loaded=waiter.loaded,
        )

    def _hand_off(
        self,
        is_ready: Callable[[str], bool],
        freed: str | None,
        now: float,
        only: str | None = None,
    ) -> list[Handoff[T]]:
        if self.fair:
            return self._hand_off_fair(is_ready, freed, now, only)
        handoffs: list[Handoff[T]] = []
        by_model: dict[str, Callable[[str], bool]] = {}
        shares = self.shares
        for waiter in self._waiters:
            if freed is not None:
                if self.ledger.is_full(freed):
                    break
                if freed not in waiter.untried:
                    continue  # cheap skip: this one can never use the freed node
            if (only is not None and waiter.client != only) or shares.at_limit(waiter.client):
                continue
            choice = self._choose(waiter, is_ready, by_model)
            if isinstance(choice, Take):
                waiter.slot = self._take(choice.node, waiter.client, now)
                handoffs.append(Handoff(waiter, waiter.slot))
        for handoff in handoffs:
            self._remove(handoff.waiter)
        return handoffs

    def _hand_off_fair(
        self,
        is_ready: Callable[[str], bool],
        freed: str | None,
        now: float,
        only: str | None,
    ) -> list[Handoff[T]]:
        """Hand slots on in fair order while ``freed`` has room (None: while anyone may take one).

        ``freed`` is the node a release freed, full until then: once a
        waiter takes it again it is full as before (the same counts), so
        the hand-off ends there without asking the ledger.

        Such a hand-off runs at nearly every release, and as a rule the
        idle client of least use takes the slot: the top of its priority's
        heap, its first waiter that may use the node. That case is written
        out first, without calls (``_best_idle``, ``_first_taker``,
        ``_choose``, ``_remove`` and ``_take`` inline); any other goes on
        to ``_hand_one_fair``, which decides every case.
        """
        # A predicate per model, and the waiters found unable to take
        # anything (every take since only fills nodes and raises counts, so
        # they stay unable in this call): made when first needed.
        by_model: dict[str, Callable[[str], bool]] | None = None
        blocked: set[Waiter[T]] | None = None
        ledger = self.ledger
        handoffs: list[Handoff[T]] | None = None
        if freed is not None and only is None:
            if ledger.is_full(freed):
                return []
            if self._idle_epoch != self.shares.epoch:  # every stored sum was scaled
                self._rebuild_idle()
            for rank, lanes in self._lanes.items():  # the highest priority that waits
                if lanes:
                    heap = self._idle.get(rank)
                    break
            else:
                return []
            while heap:
                key, _, lane = heap[0]
                use = lane.use
                if not (
                    lane.alive
                    and not use.running
                    and not use.elsewhere
                    and key == (use.scaled + use.scaled_elsewhere) / use.weight
                ):
                    heappop(heap)
                    continue
                for waiter in lane.waiters:
                    if freed not in waiter.untried:
                        continue  # it can never use the freed node
                    ready = is_ready
                    if self.ready_for is not None and waiter.model is not None:
                        by_model = {} if by_model is None else by_model
                        ready = _model_ready(by_model, waiter.model, self.ready_for)
                    choice = choose_node(
                        waiter.order,
                        tried=waiter.tried,
                        ready=ready,
                        ledger=ledger,
                        balance=self.balance,
                        preferred=waiter.preferred,
                        loaded=waiter.loaded,
                    )
                    if not isinstance(choice, Take):
                        blocked = set() if blocked is None else blocked
                        blocked.add(waiter)
                        continue
                    heappop(heap)  # its client runs from now: its entry is stale
                    del self._waiters[waiter]
                    waiters = lane.waiters
                    del waiters[waiter]
                    if not waiters:
                        lane.alive = False
                        del lanes[waiter.client]
                    node = choice.node  # choose_node has just found room there
                    slot = waiter.slot = ledger.take_free(node, waiter.client)
                    self.shares.took_use(use, now)
                    handoffs = [_new_tuple(Handoff, (waiter, slot))]  # Handoff(waiter, slot)
                    if node == freed:
                        return handoffs  # full again, as it was before the release
                    break
                else:  # none of its waiters may take the slot: the next idle client
                    by_model = {} if by_model is None else by_model
                    blocked = set() if blocked is None else blocked
                    found = None
                    if len(heap) > 1:
                        # The next entry in order is the lesser of the top's two
                        # children: if it is current and not a second entry of
                        # the top's, its client is next (its entry then stays,
                        # stale, until it comes up). Else the heap, one by one.
                        key, _, child = heap[1] if len(heap) == 2 or heap[1] < heap[2] else heap[2]
                        use = child.use
                        if (
                            child is not lane
                            and child.alive
                            and not use.running
                            and not use.elsewhere
                            and key == (use.scaled + use.scaled_elsewhere) / use.weight
                        ):
                            found = self._first_taker(
                                child.waiters, is_ready, by_model, freed, blocked
                            )
                    if found is None:
                        found = self._next_idle_taker(
                            rank, lane, is_ready, by_model, freed, blocked, set()
                        )
                    if found is not None:
                        handoffs = [self._give(*found, now)]
                        if handoffs[0].slot.node == freed:
                            return handoffs
                break
        by_model = {} if by_model is None else by_model
        blocked = set() if blocked is None else blocked
        handoffs = [] if handoffs is None else handoffs
        while freed is None or not ledger.is_full(freed):
            handoff = self._hand_one_fair(is_ready, by_model, freed, now, only, blocked)
            if handoff is None:
                break
            handoffs.append(handoff)
            if handoff.slot.node == freed:
                break  # full again, as it was before the release
        return handoffs

    def _hand_one_fair(
        self,
        is_ready: Callable[[str], bool],
        by_model: dict[str, Callable[[str], bool]],
        freed: str | None,
        now: float,
        only: str | None,
        blocked: set[Waiter[T]],
    ) -> Handoff[T] | None:
        """A slot for the next waiter by priority, use ÷ weight, arrival; None: no one may take one.

        As a rule the idle client of least use takes it: the top of its
        priority's heap, no scan. If none of its waiters may take the
        slot, the next idle one, from the heap too. Only when no idle
        client may take it, the best of the others, by one scan over the
        clients; if none of its waiters may, the next best, and so on.
        """
        for rank, lanes in self._lanes.items():  # highest priority first
            if not lanes:
                continue
            if only is not None or len(lanes) == 1:
                lane = lanes.get(only) if only is not None else next(iter(lanes.values()))
                if lane is not None and not lane.use.at_limit():
                    found = self._first_taker(lane.waiters, is_ready, by_model, freed, blocked)
                    if found is not None:
                        return self._give(*found, now)
                continue
            passed: set[_Lane[T]] = set()
            idle = self._best_idle(rank)
            if idle is not None:
                found = self._first_taker(idle.waiters, is_ready, by_model, freed, blocked)
                if found is not None:
                    heappop(self._idle[rank])  # its client runs from now: its entry is stale
                    return self._give(*found, now)
                found = self._next_idle_taker(
                    rank, idle, is_ready, by_model, freed, blocked, passed
                )
                if found is not None:
                    return self._give(*found, now)
            unit = self.shares.scale(self.shares.factor(now))
            for _ in range(len(lanes)):
                best = _best_client(lanes, unit, passed)
                if best is None:
                    break
                found = self._first_taker(best.waiters, is_ready, by_model, freed, blocked)
                if found is not None:
                    return self._give(*found, now)
                passed.add(best)
        return None

    def _give(self, waiter: Waiter[T], node: str, now: float) -> Handoff[T]:
        """Take ``waiter`` out of the queue and a slot at ``node`` for it.

        ``choose_node`` has just answered ``Take(node)`` for it: the node has room.
        """
        self._remove(waiter)
        slot = waiter.slot = self.ledger.take_free(node, waiter.client)
        self.shares.took(waiter.client, now)
        return _new_tuple(Handoff, (waiter, slot))  # Handoff(waiter, slot)

    def _next_idle_taker(
        self,
        rank: int,
        lane: _Lane[T],
        is_ready: Callable[[str], bool],
        by_model: dict[str, Callable[[str], bool]],
        freed: str | None,
        blocked: set[Waiter[T]],
        passed: set[_Lane[T]],
    ) -> tuple[Waiter[T], str] | None:
        """The first taker among the idle clients of ``rank`` after ``lane``, the best of them.

        None of ``lane``'s waiters may take a slot now. The idle clients'
        lanes come off the heap in order (least use ÷ weight first); those
        none of whose waiters may take one are added to ``passed`` and go
        back to the heap as they were (an idle client is never at its
        ``max_in_flight``: nothing runs).
        """
        heap = self._idle[rank]
        popped = []
        found = None
        while found is None:
            passed.add(lane)
            popped.append(heappop(heap))  # lane's: _best_idle left it on top
            next_lane = self._best_idle(rank)
            if next_lane is None:
                break
            lane = next_lane
            if lane not in passed:  # else a second entry of one passed
                found = self._first_taker(lane.waiters, is_ready, by_model, freed, blocked)
        for entry in popped:
            heappush(heap, entry)
        return found

    def _first_taker(
        self,
        lane: dict[Waiter[T], None],
        is_ready: Callable[[str], bool],
        by_model: dict[str, Callable[[str], bool]],
        freed: str | None,
        blocked: set[Waiter[T]],
    ) -> tuple[Waiter[T], str] | None:
        """The longest-waiting of ``lane`` that may take a slot now, and where."""
        for waiter in lane:
            if freed is not None and freed not in waiter.untried:
                continue  # it can never use the freed node
            if waiter in blocked:
                continue
            choice = self._choose(waiter, is_ready, by_model)
            if isinstance(choice, Take):
                return waiter, choice.node
            blocked.add(waiter)
        return None


def _arrival(waiter: Waiter[Any]) -> int:
    return waiter.seq


@dataclass(eq=False, slots=True)
class _Lane(Generic[T]):
    """One client's waiters of one priority, in arrival order, and its use record."""

    use: ClientUse
    waiters: dict[Waiter[T], None] = field(default_factory=dict)
    alive: bool = True
    """False once its last waiter left: a newer lane may stand for its client."""


def _best_client(
    lanes: Mapping[str, _Lane[T]], unit: float, passed: AbstractSet[_Lane[T]]
) -> _Lane[T] | None:
    """The lane whose client goes first, but ``passed`` and the clients at their limit.

    First a client with nothing running, then the lowest use ÷ weight;
    ties in the order the lanes began. Running and use are fleet-wide: the
    client's own here plus the other replicas' (0 without). One pass, no
    tuples, no calls: this runs at every hand-off of a fair queue.
    """
    best: _Lane[T] | None = None
    best_busy = True
    best_key = math.inf
    for lane in lanes.values():
        if passed and lane in passed:
            continue
        use = lane.use
        running = use.running + use.elsewhere
        if running:
            if running >= use.max_in_flight > 0:
                continue  # at its max_in_flight, fleet-wide
            if not best_busy:
                continue  # an idle client is ahead already
            key = (use.scaled + use.scaled_elsewhere + running * unit) / use.weight
            if key < best_key:
                best, best_key = lane, key
        else:
            key = (use.scaled + use.scaled_elsewhere) / use.weight
            if best_busy or key < best_key:
                best, best_busy, best_key = lane, False, key
    return best


def _client_key(use: ClientUse, unit: float) -> tuple[bool, float]:
    """Where a client stands in the fair order (lower first): running anything, use ÷ weight.

    ``_best_client``'s two keys, as one value.
    """
    running = use.running + use.elsewhere
    return bool(running), (use.scaled + use.scaled_elsewhere + running * unit) / use.weight


# The priorities' ranks, highest first (``sharing.PRIORITIES``).
_RANKS = tuple(range(len(PRIORITIES)))
# Releases between two looks for idle clients to forget (``ShareBook.forget``).
FORGET_EVERY = 4096


# -- the queue-timeout budget ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueBudget:
    """What is left of one workload's queue timeout across all its waits.

    A failed-over workload that must wait again waits within the same
    budget, so a client never waits longer than the queue timeout in all.
    """

    timeout: float
    """The queue timeout in seconds, ``0`` = no limit."""
    waited: float = 0.0
    """Seconds this workload has waited so far (for the access log too)."""

    def __post_init__(self) -> None:
        if not self.timeout >= 0 or not self.waited >= 0:  # also rejects NaN
            raise ValueError(f"timeout and waited must be >= 0: {self.timeout}, {self.waited}")

    def remaining(self) -> float:
        """Seconds the next wait may last; ``math.inf`` without limit, never < 0."""
        if self.timeout == 0:
            return math.inf
        return max(self.timeout - self.waited, 0.0)

    def deadline(self, now: float) -> float:
        """Absolute time at which a wait starting at ``now`` ends (for ``move_on_at``)."""
        return now + self.remaining()

    def spent(self, started: float, now: float) -> QueueBudget:
        """The budget after a wait from ``started`` to ``now``."""
        return QueueBudget(self.timeout, self.waited + max(now - started, 0.0))
