"""Pure: each node's slots (``SlotLedger``) and where one workload's next attempt goes.

``choose_node`` decides from the ledger's counts and an answer to "is this
node ready?"; it takes nothing. Taking, queueing and handing slots on is
the scheduler's (``slot_queue.py``). ``slots.py`` tells how the two serve
the shell, and re-exports both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias

__all__ = [
    "BALANCE_MODES",
    "Balance",
    "Choice",
    "EngineLoad",
    "Exhausted",
    "NodeFull",
    "Readiness",
    "Slot",
    "SlotLedger",
    "Take",
    "Wait",
    "as_predicate",
    "choose_node",
]

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
        """What ``least-loaded`` minimises (``engines.load_key``).

        ``in_flight / max(capacity, 1)`` without a signal; with one,
        ``(max(in_flight, busy) + waiting) / max(capacity, 1)``, ``busy``
        moved as in ``engine_busy``. Float division is exact enough for
        ties: two equal ratios of small ints round to the same float, so
        "ties in resolved order" holds.
        """
        reading = self.signals.get(node) if self.signals else None
        if reading is None:
            return self._in_flight[node] / max(self._capacity[node], 1)
        busy = self.engine_busy(node)
        in_flight = self._in_flight[node] if busy is None else busy
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
