"""The slot scheduler in the Trio shell: slots per attempt, the queue of waiters.

``core/slots.py`` decides (who takes which slot, who waits, who is handed a
freed slot); this module carries the decisions out. A waiting workload is
parked on its own ``trio.Event``; a decision that hands it a slot sets that
event and no other, so a freed slot wakes exactly one workload, and no task
runs per waiter. The waiter's own ``move_on_at`` is its queue timeout.

Readiness comes from one predicate, ``NodeBoard.is_demoted`` (cooling, and
whatever else demotes a node), asked lazily with the current time. While
some model of some node cools (``ModelCooldowns.by_model``),
it is asked with the workload's model too; otherwise it is asked as
before, at no extra cost to the request path. Whoever
changes a node between ready and demoted calls ``dispatch()``: that can let
a waiter onto a node it could not use before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Protocol

import trio

from ...core.config import Config
from ...core.cooldown import ModelCooldowns
from ...core.engine_book import EngineChange
from ...core.engines import capacity_at_start
from ...core.node_change import ChangeKind, NodeChange
from ...core.sharing import ANONYMOUS, NORMAL
from ...core.slots import Acquired, Handoff, Queued, Slot, SlotLedger, SlotScheduler, Waiter
from ...telemetry.metrics import Metrics


class Demoted(Protocol):
    """``(node, now[, model]) -> bool``: ``NodeBoard.is_demoted``."""

    def __call__(self, node: str, now: float, model: str | None = None, /) -> bool: ...


# Why the queue turned a workload away -> the code and message of its 503.
REFUSALS = {
    "queue_full": ("queue_full", "every candidate node is full and so is the queue"),
    "queue_timeout": ("queue_timeout", "no slot at any candidate node within the queue timeout"),
    "shutdown": ("shutting_down", "the proxy is shutting down"),
}


class SlotQueue:
    """One proxy's slots and queue (a ``SlotScheduler`` of parked ``trio.Event``)."""

    def __init__(
        self, config: Config, is_demoted: Demoted, models: ModelCooldowns | None = None
    ) -> None:
        """An empty queue; every node's capacity from ``config``.

        Args:
            config: capacities, ``balance`` and ``max_queue``.
            is_demoted: ``(node, now, model) -> bool``, the one readiness predicate.
            models: the board's per-model cooldowns, read only (falsy: none).
        """
        self.scheduler: SlotScheduler[trio.Event] = SlotScheduler(
            # Capacity auto (None) limits nothing until its engine says (the
            # engine holder sets it then), but where its configured kind
            # fixes it (llama-cpp-python: 1).
            {node.name: capacity_at_start(node.capacity, node.engine) for node in config.upstreams},
            balance=config.balance,
            max_queue=config.max_queue,
            fair=config.fair_share == "on",
        )
        self.scheduler.configure_clients(client_shares(config))
        self._is_demoted = is_demoted
        # The board's dict itself: empty while no model cools (one test per acquire).
        self._models = (ModelCooldowns() if models is None else models).by_model
        self.scheduler.ready_for = self._ready_for  # for the queued waiters' models
        self.closed = False
        # Set (and replaced) when the ticker's next wake-up may have moved
        # earlier: the queue stopped being empty, or a cooldown began.
        self._schedule_changed = trio.Event()

    def __len__(self) -> int:
        """Workloads waiting now."""
        return len(self.scheduler)

    def is_ready(self, node: str) -> bool:
        """Whether ``node`` is ready now (not demoted)."""
        return not self._is_demoted(node, trio.current_time())

    def _ready_for(self, model: str) -> Callable[[str], bool]:
        """The readiness of the nodes for a waiter asking for ``model``."""
        is_demoted = self._is_demoted

        def ready(node: str) -> bool:
            return not is_demoted(node, trio.current_time(), model)

        return ready

    # -- one attempt ---------------------------------------------------------

    def acquire(
        self,
        order: Sequence[str],
        *,
        tried: Iterable[str],
        preferred: str | None,
        now: float | None = None,
        loaded: frozenset[str] = frozenset(),
        model: str | None = None,
        client: str = ANONYMOUS,
        rank: int = NORMAL,
    ) -> Acquired[trio.Event]:
        """Decide the next attempt: a slot now, a place in the queue, or why not.

        A ``Queued`` waiter is in the queue already: ``wait`` for it next,
        or ``leave`` it. After ``close()`` nobody is queued any more.
        ``now``, when the caller read the clock since its last checkpoint,
        spares the readiness test a reading of its own. ``loaded``: the
        nodes holding the request's model loaded, tried first.
        ``model``: the one it asks for, for its per-model cooldowns.
        ``client`` and ``rank``: whose it is and its priority (fair share).
        A waiter of a lower priority that this one displaced from a full
        queue is woken without a slot (``displaced``: ``503 queue_full``).
        """
        ready = self.is_ready
        is_demoted = self._is_demoted
        if model is not None and self._models:
            at = trio.current_time() if now is None else now

            def ready(node: str) -> bool:
                return not is_demoted(node, at, model)

        elif now is not None:

            def ready(node: str) -> bool:
                return not is_demoted(node, now)

        result = self.scheduler.acquire(
            trio.Event(),
            order,
            tried=tried,
            ready=ready,
            preferred=preferred,
            loaded=loaded,
            client=client,
            rank=rank,
            now=trio.current_time() if now is None else now,
        )
        if isinstance(result, Queued):
            result.waiter.model = model
            if result.displaced is not None:
                result.displaced.token.set()
            if len(self.scheduler) == 1:
                self._changed()
        return result

    async def wait(self, waiter: Waiter[trio.Event], deadline: float) -> Slot | None:
        """Wait until a hand-off gives ``waiter`` a slot; None at ``deadline`` or close.

        Cancellation: the waiter leaves the queue (a slot handed to it in
        that same instant goes on to the next waiter), then ``Cancelled``
        propagates.
        """
        if self.closed:  # a newcomer during the drain: nothing frees for it
            self.leave(waiter)
            return None
        try:
            with trio.move_on_at(deadline):
                await waiter.token.wait()
        except BaseException:
            self.leave(waiter)
            raise
        if waiter.slot is None:
            self.leave(waiter)
        return waiter.slot

    def leave(self, waiter: Waiter[trio.Event]) -> None:
        """``waiter`` will not use a slot: out of the queue, its slot handed on."""
        self._wake(self.scheduler.leave(waiter, ready=self.is_ready, now=trio.current_time()))

    def release(self, slot: Slot) -> None:
        """Give the attempt's slot back (a second call is a no-op); wake who gets it."""
        handoffs = self.scheduler.release(slot, ready=self.is_ready, now=trio.current_time())
        if handoffs:
            self._wake(handoffs)

    # -- node changes and shutdown -------------------------------------------

    def dispatch(self) -> None:
        """A node changed between ready and demoted: hand out what waiters may use now."""
        if len(self.scheduler):
            self._wake(self.scheduler.dispatch(ready=self.is_ready, now=trio.current_time()))

    def board_changed(self, record: object) -> None:
        """The node board's listener: a node's readiness, load or capacity changed.

        A ``NodeChange``: it changed between ready and demoted. An
        ``EngineChange``: a read may have changed its load or capacity. The
        board's other records (a check's) change nothing here.
        """
        if isinstance(record, NodeChange):
            if record.kind is ChangeKind.COOLING:
                self.demoted()  # also lets the ticker see its end
            else:
                self.dispatch()
        elif isinstance(record, EngineChange):
            self._engine_changed(record)

    def _engine_changed(self, change: EngineChange) -> None:
        changed = change.changed
        if change.fresh:
            # The engine's count is of now, this proxy's attempts of now among it.
            self.scheduler.ledger.note_reading(change.node)
            changed = True
        if change.capacity is not None:  # capacity auto: the engine's own
            changed = self.scheduler.ledger.set_capacity(change.node, change.capacity) or changed
        if changed:
            self.dispatch()

    def demoted(self) -> None:
        """A node was demoted: dispatch, and let the ticker see its end time."""
        if len(self.scheduler):
            self._changed()
            self.dispatch()

    def reconfigure(self, config: Config, *, moved: bool) -> None:
        """A reload: the new capacities, balance and queue length (``SlotScheduler.reconfigure``).

        ``moved``: the node list changed; every waiter wakes without a slot
        and with ``moved`` set, to resolve its candidates again.
        """
        waiters = self.scheduler.reconfigure(
            _reload_capacities(config, self.scheduler.ledger),
            balance=config.balance,
            max_queue=config.max_queue,
            moved=moved,
        )
        self.scheduler.fair = config.fair_share == "on"
        self.scheduler.configure_clients(client_shares(config))
        for waiter in waiters:
            waiter.token.set()
        self.dispatch()

    def close(self) -> None:
        """Shutdown: empty the queue; each waiter wakes without a slot (``503``)."""
        self.closed = True
        for waiter in self.scheduler.drain():
            waiter.token.set()

    def wake_at(self, cooldown_ends: Iterable[float]) -> float:
        """When the ticker must look again: the first cooldown end, while anyone waits."""
        if not len(self.scheduler):
            return math.inf
        return min(cooldown_ends, default=math.inf)

    async def wait_schedule_changed(self) -> None:
        """Return once ``wake_at`` may have moved earlier (for the ticker)."""
        await self._schedule_changed.wait()

    def _changed(self) -> None:
        self._schedule_changed.set()
        self._schedule_changed = trio.Event()

    @staticmethod
    def _wake(handoffs: list[Handoff[trio.Event]]) -> None:
        for handoff in handoffs:
            handoff.waiter.token.set()


def client_shares(config: Config) -> dict[str, tuple[float, int]]:
    """The configured clients' ``(weight, max_in_flight)``, for the scheduler."""
    return {client.name: (client.weight, client.max_in_flight) for client in config.clients}


def _reload_capacities(config: Config, ledger: SlotLedger) -> dict[str, int]:
    """A reload's capacities: an ``auto`` node keeps what its engine gave.

    A new node, or one whose configured kind fixes its capacity
    (llama-cpp-python), starts as ``capacity_at_start`` says.
    """
    kept = set(ledger.nodes)
    capacities: dict[str, int] = {}
    for node in config.upstreams:
        start = capacity_at_start(node.capacity, node.engine)
        keeps = node.capacity is None and not start and node.name in kept
        capacities[node.name] = ledger.capacity(node.name) if keeps else start
    return capacities


def gauge_in_flight(metrics: Metrics, nodes: Iterable[str], queue: SlotQueue) -> None:
    """Have the in-flight gauges of ``nodes`` read ``queue``'s ledger at scrape time."""
    ledger = queue.scheduler.ledger
    for node in nodes:
        # Read at scrape time: no gauge update per attempt.
        metrics.in_flight.labels(node).set_function(partial(ledger.in_flight, node))
        metrics.capacity.labels(node).set_function(partial(ledger.capacity, node))
        metrics.engine_busy.labels(node).set_function(partial(_engine_count, ledger, node, True))
        metrics.engine_waiting.labels(node).set_function(
            partial(_engine_count, ledger, node, False)
        )


def _engine_count(ledger: SlotLedger, node: str, busy: bool) -> float:
    """The engine's busy (or waiting) count of ``node`` as the ledger reads it; NaN: none."""
    reading = ledger.signals.get(node)
    count = None if reading is None else reading.busy if busy else reading.waiting
    return math.nan if count is None else float(count)
