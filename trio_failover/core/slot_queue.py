"""Pure: the FIFO queue of waiting workloads, the ``SlotScheduler``, the queue budget.

The scheduler takes and hands on the slots of ``slot_ledger.py``'s ledger
by its ``choose_node``; ``slots.py`` tells how the shell drives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeAlias, TypeVar

from .slot_ledger import (
    BALANCE_MODES,
    Balance,
    EngineLoad,
    Exhausted,
    Readiness,
    Slot,
    SlotLedger,
    Take,
    as_predicate,
    choose_node,
)

__all__ = [
    "Acquired",
    "Granted",
    "Handoff",
    "QueueBudget",
    "QueueFull",
    "Queued",
    "ReadyFor",
    "SlotScheduler",
    "Waiter",
]

T = TypeVar("T")


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


class Handoff(NamedTuple, Generic[T]):
    """``waiter`` now holds ``slot``: the shell wakes it (``waiter.slot`` is set too)."""

    waiter: Waiter[T]
    slot: Slot


@dataclass(frozen=True, slots=True)
class Granted:
    """A slot is taken for the workload: attempt ``slot.node`` now."""

    slot: Slot


@dataclass(frozen=True, slots=True)
class Queued(Generic[T]):
    """The workload waits as ``waiter``; a hand-off will set ``waiter.slot``."""

    waiter: Waiter[T]


@dataclass(frozen=True, slots=True)
class QueueFull:
    """The queue is at max-queue: answer ``503`` ``queue_full`` at once."""


Acquired: TypeAlias = Granted | Queued[T] | QueueFull | Exhausted


class SlotScheduler(Generic[T]):
    """The ledger and the FIFO queue of one proxy, deciding together.

    Costs: ``acquire`` is O(candidates); ``release`` with an empty queue,
    or of a node that was not full, is O(1) and never asks ``ready``;
    ``leave`` of a waiting workload is O(1). A hand-off scans the waiters
    in arrival order and stops as soon as the freed node is full again.
    """

    def __init__(
        self,
        capacities: Mapping[str, int],
        *,
        balance: Balance = "priority",
        max_queue: int = 0,
        signals: Mapping[str, EngineLoad] | None = None,
    ) -> None:
        """An empty queue and a ledger with nothing in flight.

        Args:
            capacities: node name -> capacity, ``0`` = no limit.
            signals: the engines' readings by node, for the ledger
                (``SlotLedger``); None = none.
            balance: ``priority`` or ``least-loaded``.
            max_queue: most workloads waiting at once, ``0`` = no limit.

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
        # An insertion-ordered dict is the FIFO: arrival order to iterate,
        # O(1) removal from the middle when a waiter leaves.
        self._waiters: dict[Waiter[T], None] = {}

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
    ) -> Acquired[T]:
        """Decide and reserve the next attempt of one workload.

        Args: as ``choose_node``; ``token`` is kept on the waiter if it waits.

        Returns:
            ``Granted(slot)``: the slot is taken, attempt its node.
            ``Queued(waiter)``: all it may use is full; it waits at
            ``waiter.position``. ``QueueFull()``: it would make the queue
            longer than ``max_queue``. ``Exhausted()``: nothing untried left.
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
        if isinstance(choice, Take):
            return Granted(self.ledger.take(choice.node))
        if isinstance(choice, Exhausted):
            return choice
        if self.max_queue and len(self._waiters) >= self.max_queue:
            return QueueFull()
        waiter = Waiter(
            token=token,
            order=tuple(order),
            tried=tried,
            preferred=preferred,
            position=len(self._waiters) + 1,
            untried=frozenset(order) - tried,
            loaded=frozenset(loaded),
        )
        self._waiters[waiter] = None
        return Queued(waiter)

    def release(self, slot: Slot, *, ready: Readiness) -> list[Handoff[T]]:
        """Give ``slot`` back (again: no-op) and hand the freed slot on.

        Returns:
            The waiters that now hold a slot, to wake (one, as a rule).
        """
        node = slot.node
        was_full = self.ledger.is_full(node)
        if not self.ledger.release(slot) or not was_full or not self._waiters:
            # Not full before: no waiter was waiting for this node (rule 2),
            # so nobody's options changed. This is the hot path.
            return []
        return self._hand_off(_asked_once(ready), freed=node)

    def leave(self, waiter: Waiter[T], *, ready: Readiness) -> list[Handoff[T]]:
        """The workload gives up (client gone, timeout, shutdown, error).

        Removes it from the queue if it still waits (O(1)). If a hand-off
        already gave it a slot it will not use, that slot is released and
        handed on. Call it only when the workload will not use the slot;
        a second call is a no-op.
        """
        if waiter in self._waiters:
            del self._waiters[waiter]
            return []
        if waiter.slot is None:  # left already
            return []
        return self.release(waiter.slot, ready=ready)

    def dispatch(self, *, ready: Readiness) -> list[Handoff[T]]:
        """Hand out what the waiters may use now, after a node changed state.

        A node turning cooling can let a waiter use a cooling node that is
        free (when none of its untried candidates stays ready); a node
        turning ready can give a waiter a free node it could not use.
        O(waiters x candidates): call it on state changes, not per request.
        """
        if not self._waiters:
            return []
        return self._hand_off(_asked_once(ready), freed=None)

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
        return waiters

    def _hand_off(self, is_ready: Callable[[str], bool], freed: str | None) -> list[Handoff[T]]:
        handoffs: list[Handoff[T]] = []
        ready_for = self.ready_for
        by_model: dict[str, Callable[[str], bool]] = {}
        for waiter in self._waiters:
            if freed is not None:
                if self.ledger.is_full(freed):
                    break
                if freed not in waiter.untried:
                    continue  # cheap skip: this one can never use the freed node
            choice = choose_node(
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
            if isinstance(choice, Take):
                waiter.slot = self.ledger.take(choice.node)
                handoffs.append(Handoff(waiter, waiter.slot))
        for handoff in handoffs:
            del self._waiters[handoff.waiter]
        return handoffs


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
