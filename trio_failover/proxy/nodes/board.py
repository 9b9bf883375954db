"""The node board: every node's state, and the one place it changes.

``NodeBoard`` holds, per node (``NodeState``), its cooldown, whether it is
down and its last check, its inventory and ``/api/tags`` answer, its last
outcome and error, its served and failed counters, and what this proxy's
streams and re-check asks need. The decisions are the pure core's
(``cooldown.py``, ``inventory.py``); the board keeps their results.

The contract, for this board and for one over a shared store (issue 31):

- State changes only through the verbs: ``demote``, ``served``,
  ``attempt_ended``, ``check_finished``, ``liveness_checked``, ``expire``,
  ``keep_tags``, ``reconcile``, ``apply`` and ``judge_engine``. Nothing else
  writes a ``NodeState`` (the stream counter and the re-check event are
  this process's own).
- What the board keeps of a node is a record (``core/node_change.py``): a
  change of its readiness (``NodeChange``), its inventory
  (``InventoryChange``), its last check (``LastCheck``), a read of its
  engine (``engine_state.EngineRead``). The verbs make them and hand them
  to ``apply``, which changes the state and then calls every listener
  (``listen``) with the record as applied (a ``COOLING`` record then says
  how long the kept cooldown runs; an engine read is told as the
  ``EngineChange`` its fold left, the read in it). One list of listeners
  for all of them: each takes the records it cares for. Listeners run
  synchronously, in the order they were added, and must not raise: the
  queue's dispatch, the events, log lines and gauges, and the replicas'
  fleet are listeners (``proxy.py`` wires them), not code in here.
- ``apply`` also takes records made elsewhere (another replica's), their
  ``origin`` set: a ``NodeChange``'s ``remaining`` counts from the moment
  it is applied. Readiness never changes with a remote check's records
  (it comes as ``NodeChange`` records of its own).
- Reads: ``is_demoted`` (the one readiness predicate the slot queue asks),
  ``cooldown``, ``is_down``, ``inventories``, ``nodes`` (the per-node view
  of ``/status``), ``wake_at`` (the next cooldown's end, for the ticker).

``model=``: a cooldown for one model of a node, by the name
the client asked for (``llama3`` and ``llama3:latest`` are one model:
``names.spellings``; the caller decides the scope with
``engines.cooldown_scope``). Kept in ``model_cooldowns``
(``core.cooldown.ModelCooldowns``) beside the node-wide ``cooldowns``;
``is_demoted(node, now, model)`` asks both. Records with a ``model`` speak
of that model only: ``COOLING`` demotes it, ``READY`` (a served answer for
it, or its expiry on a node not down) and ``COOLED`` (its expiry on a down
node) end it; node-wide records never touch model cooldowns; ``DOWN``
and ``UP`` with a model are ignored.

Engines (docs/engines.md): the reader hands each read (an ``EngineRead``)
to ``apply``, which folds it into ``engines`` (an ``EngineBook``: states,
the ledger's fresh ``signals``, ``auto`` capacities) and tells the
listeners the ``EngineChange`` it left. Another replica's read comes in
the same way; ``judge_engine`` lets it go stale. ``configure_engines``
takes a reload's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import attrs
import trio

from ...core.cooldown import Cooldown, CooldownTable, ModelCooldowns, ends_cooldown
from ...core.engine_book import EngineBook, EngineChange, EngineSettings
from ...core.engine_state import EngineRead
from ...core.inventory import (
    DOWN_REASON,
    READY_REASON_CHECK,
    READY_REASON_SERVED,
    CheckVerdict,
    Health,
)
from ...core.liveness import DOWN_REASON as LIVENESS_DOWN
from ...core.liveness import CheckRecord
from ...core.node_change import ChangeKind, InventoryChange, LastCheck, NodeChange

__all__ = ["BoardRecord", "NodeBoard", "NodeState", "Record"]

Record = NodeChange | InventoryChange | LastCheck | EngineRead
"""What ``apply`` takes: a record made here, or another replica's."""
BoardRecord = NodeChange | InventoryChange | LastCheck | EngineChange
"""What the listeners hear: each record as applied (an engine read as its fold's change)."""
Listener = Callable[[BoardRecord], None]


@attrs.define
class NodeState:
    """One node's state, as the board keeps it (``Proxy.stats`` shows these)."""

    served: int = 0
    failed: int = 0
    down: bool = False
    down_reason: str | None = None  # why it is down: a health check, or a liveness check
    # The node's last finished check (a liveness check, or discovery's).
    last_check: CheckRecord | None = None
    inventory: tuple[str, ...] | None = None
    # The entries of its last /api/tags answer; None: it gave none (yet).
    tags: list[dict[str, object]] | None = None
    last_outcome: str | None = None
    last_error: str | None = None
    # Set to ask the node's checker for a check now; replaced as a check begins.
    recheck: trio.Event = attrs.Factory(trio.Event)


class NodeBoard:
    """Every node's ``NodeState`` and cooldowns; changed only by its verbs."""

    def __init__(self, names: Iterable[str]) -> None:
        self.nodes = {name: NodeState() for name in names}
        self.configured = tuple(self.nodes)  # in force; ``nodes`` also has retired ones
        # Only the nodes with an inventory: what ranking filters on, and
        # empty (nothing to parse a body for) until a check lists models.
        self.inventories: dict[str, tuple[str, ...]] = {}
        self.cooldowns = CooldownTable()  # node-wide; read it, never write it
        # By node and model; the slot queue reads its ``by_model``.
        self.model_cooldowns = ModelCooldowns()
        self._listeners: list[Listener] = []
        self.engines = EngineBook(EngineSettings())  # read it; ``apply`` changes it

    def listen(self, listener: Listener) -> None:
        """Have ``listener`` called with every record the board applies, in order."""
        self._listeners.append(listener)

    # -- reads ---------------------------------------------------------------

    def is_demoted(self, name: str, now: float, model: str | None = None) -> bool:
        """Whether ``name`` is demoted behind the ready nodes at ``now``: cooling or down.

        The one readiness predicate: the slot queue asks this (and nothing
        else) at each attempt. Every change of its answer other than a
        cooldown's expiry is a ``NodeChange`` (the queue's listener
        dispatches); the ticker sees to expiries. ``model``: also demoted
        when that model of the node cools (asked only while any does).
        """
        if self.cooldowns.is_cooling(name, now) or self.nodes[name].down:
            return True
        return model is not None and self._model_demoted(name, now, model)

    def _model_demoted(self, name: str, now: float, model: str) -> bool:
        cooling = self.model_cooldowns
        return bool(cooling.by_model) and cooling.get(name, model, now) is not None

    def cooldown(self, name: str, now: float, *, model: str | None = None) -> Cooldown | None:
        """The node's (or its model's) cooldown still running at ``now``, if any."""
        if model is None:
            return self.cooldowns.get(name, now)
        return self.model_cooldowns.get(name, model, now)

    def is_down(self, name: str) -> bool:
        """Whether the node's last health check failed (and nothing served since)."""
        return self.nodes[name].down

    def down_because(self, name: str) -> str | None:
        """Why the node is down (its ``down_reason``); None while it is not, or unknown."""
        state = self.nodes.get(name)
        if state is None or not state.down:
            return None
        return state.down_reason or "down"

    def down_count(self) -> int:
        """How many nodes are down now."""
        return sum(node.down for node in self.nodes.values())

    def wake_at(self) -> float:
        """When the next cooldown (node-wide or a model's) ends (``inf``: none), for the ticker.

        One that ran out unnoticed counts too: it ended, so the ticker looks now.
        """
        ends = [entry.until for entry in self.cooldowns.active(-math.inf)]
        if self.model_cooldowns.by_model:
            ends += self.model_cooldowns.ends()
        return min(ends, default=math.inf)

    def known_tags(self, name: str) -> list[dict[str, object]] | None:
        """The ``models`` entries of the node's last ``/api/tags`` answer to a check.

        None while it has given none (discovery off, not asked yet, not a
        tags list); a check without any answer keeps the one before. Read only.
        """
        return self.nodes[name].tags

    # -- this process's own: the re-check asks -------------------------------

    def ask_recheck(self, name: str) -> None:
        """Have the node's checker check it now (or right after its running check)."""
        self.nodes[name].recheck.set()

    def take_recheck(self, name: str) -> trio.Event:
        """A fresh re-check event for a check that begins now; a later ask sets it."""
        event = self.nodes[name].recheck = trio.Event()
        return event

    # -- the verbs -----------------------------------------------------------

    def demote(
        self, node: str, duration: float, reason: str, now: float, *, model: str | None = None
    ) -> None:
        """Cool ``node`` (or its ``model``) down for ``duration`` seconds from ``now``."""
        key = None if model is None else self.model_cooldowns.key(model)
        self.apply(NodeChange(ChangeKind.COOLING, node, reason, duration, key), now)

    def served(self, node: str, status: int, now: float, *, model: str | None = None) -> None:
        """Count a committed answer; one below 500 ends the cooldown and the down flag.

        ``model``: the model the client asked for: its cooldown on the node ends too.
        """
        state = self.nodes[node]
        state.served += 1
        if not ends_cooldown(status):
            return
        if model is not None and self.model_cooldowns.by_model:  # the common case skips it
            key = self.model_cooldowns.key(model)
            if self.model_cooldowns.get(node, key, -math.inf) is not None:
                self.apply(NodeChange(ChangeKind.READY, node, READY_REASON_SERVED, model=key), now)
        entry = self.cooldowns.get(node, -math.inf)
        if state.down or (entry is not None and entry.until > now):
            self.apply(NodeChange(ChangeKind.READY, node, READY_REASON_SERVED), now)
        elif entry is not None:  # ran out unnoticed: gone, no news
            self.apply(NodeChange(ChangeKind.COOLED, node, "expired"), now)

    def attempt_ended(self, node: str, outcome: str, error: str | None, *, failed: bool) -> None:
        """Keep an attempt's or stream's outcome (and error, if any); count a failure."""
        state = self.nodes[node]
        state.last_outcome = outcome
        if error is not None:
            state.last_error = error
        if failed:
            state.failed += 1

    def check_finished(
        self, node: str, verdict: CheckVerdict, now: float, *, record: CheckRecord | None = None
    ) -> None:
        """Keep a finished discovery check: its verdict, inventory and ``last_check``.

        ``record``: the check as ``/status`` shows it (None: leave ``last_check``).
        """
        state = self.nodes[node]
        _keep_verdict(state, verdict)
        if verdict.replace_inventory:
            self.apply(InventoryChange(node, verdict.inventory), now)
        if record is not None:
            self.apply(LastCheck(node, record), now)
        if verdict.health is Health.DOWN and not state.down:
            change = NodeChange(ChangeKind.DOWN, node, DOWN_REASON, error=verdict.last_error)
            self.apply(change, now)
        elif verdict.health is Health.READY and state.down:
            self._up(node, READY_REASON_CHECK, now)

    def _up(self, node: str, reason: str, now: float) -> None:
        """A down node answers again: ready, or still cooling for what its cooldown has left."""
        entry = self.cooldowns.get(node, now)
        if entry is None:
            self.apply(NodeChange(ChangeKind.READY, node, reason), now)
        else:
            self.apply(NodeChange(ChangeKind.UP, node, reason, entry.remaining(now)), now)

    def liveness_checked(self, node: str, record: CheckRecord, now: float) -> None:
        """Keep a finished liveness check as the node's ``last_check``; a failed one marks it down.

        A node that answered nothing is ``down`` (reason ``unresponsive``)
        and its re-check is asked for (discovery's backoff); a check that
        passes brings back a node that only a liveness check had marked
        down (a health check's ``5xx`` verdict stays discovery's to end).
        """
        state = self.nodes.get(node)
        if state is None:
            return
        self.apply(LastCheck(node, record), now)
        if not record.ok and not state.down:
            self.apply(NodeChange(ChangeKind.DOWN, node, LIVENESS_DOWN, error=record.error), now)
            self.ask_recheck(node)
        elif record.ok and state.down and state.down_reason == LIVENESS_DOWN:
            self._up(node, READY_REASON_CHECK, now)

    def keep_tags(self, node: str, entries: list[dict[str, object]] | None) -> None:
        """Keep the node's answer to a check's ``GET /api/tags`` (None: not a tags answer)."""
        self.nodes[node].tags = entries

    def expire(self, now: float) -> None:
        """Notice the cooldowns that ran out by ``now``: ``READY`` for the nodes not down."""
        if self.model_cooldowns.by_model:
            for model, entry in self.model_cooldowns.expire(now):
                kind = ChangeKind.COOLED if self.nodes[entry.node].down else ChangeKind.READY
                self.apply(NodeChange(kind, entry.node, "expired", model=model), now)
        ended = self.cooldowns.expire(now)
        if not ended:  # asked at every workload: the common answer costs nothing
            return
        for entry in ended:
            # A down node stays demoted: "ready" would be false news.
            kind = ChangeKind.COOLED if self.nodes[entry.node].down else ChangeKind.READY
            self.apply(NodeChange(kind, entry.node, "expired"), now)

    def reconcile(self, names: Iterable[str]) -> None:
        """A reload's nodes: new ones fresh, kept ones as they are, removed ones retired.

        A retired node keeps only its ``NodeState`` (its running workloads
        still write to it); a name added again starts afresh.
        """
        wanted = list(names)
        for name in [name for name in self.configured if name not in wanted]:
            self.inventories.pop(name, None)
            self.cooldowns.restore(name)
            self.model_cooldowns.forget(name)
            self.nodes[name].down = False
        for name in wanted:
            if name not in self.configured:
                self.nodes[name] = NodeState()
                self.inventories.pop(name, None)
        self.configured = tuple(wanted)

    # -- the one writer of readiness -----------------------------------------

    def apply(self, record: Record, now: float) -> None:
        """Apply ``record`` at ``now`` (this replica's or another's), then tell the listeners.

        A record of a node this board does not have (a remote's older fleet) is ignored.
        """
        if isinstance(record, NodeChange):
            self._apply_change(record, now)
        elif isinstance(record, EngineRead):
            self._tell_engine(self.engines.fold(record, now))
        else:
            self._keep_check(record)

    def _keep_check(self, record: InventoryChange | LastCheck) -> None:
        """Keep a check's inventory or ``last_check``: never its readiness."""
        state = self.nodes.get(record.node)
        if state is None:
            return
        if isinstance(record, LastCheck):
            state.last_check = record.check
        else:
            state.inventory = record.models
            if record.models:
                self.inventories[record.node] = record.models
            else:
                self.inventories.pop(record.node, None)
        self._tell(record)

    def _apply_change(self, change: NodeChange, now: float) -> None:
        """``apply`` of a change of readiness."""
        state = self.nodes.get(change.node)
        if state is None:  # a node this board does not have (a remote's older fleet)
            return
        kind = change.kind
        if change.model is not None:
            self._apply_model(change, now)
            return
        if kind is ChangeKind.COOLING:
            entry = self.cooldowns.demote(
                change.node, now=now, duration=change.remaining, reason=change.reason
            )
            change = attrs.evolve(change, remaining=entry.remaining(now))
        elif kind is ChangeKind.READY:
            self.cooldowns.restore(change.node)
            state.down, state.down_reason = False, None
        elif kind is ChangeKind.DOWN:
            state.down, state.down_reason = True, change.reason
        elif kind is ChangeKind.UP:
            state.down, state.down_reason = False, None
        else:  # COOLED: ran out (already gone here)
            self.cooldowns.restore(change.node)
        self._tell(change)

    def _apply_model(self, change: NodeChange, now: float) -> None:
        """``apply`` of a record for one model: only that model's cooldown changes."""
        model = change.model
        assert model is not None
        if change.kind is ChangeKind.COOLING:
            entry = self.model_cooldowns.demote(
                change.node, model, now=now, duration=change.remaining, reason=change.reason
            )
            change = attrs.evolve(change, remaining=entry.remaining(now))
        elif change.kind in (ChangeKind.READY, ChangeKind.COOLED):
            self.model_cooldowns.restore(change.node, model)
        else:  # DOWN and UP are the node's, never a model's
            return
        self._tell(change)

    def _tell(self, record: BoardRecord) -> None:
        for listener in self._listeners:
            listener(record)

    # -- the engines ---------------------------------------------------------
    # A read changes no node's readiness, only its load and capacity.

    def configure_engines(self, settings: EngineSettings) -> None:
        """Take the engine settings of a (re)loaded configuration."""
        self.engines.configure(settings)

    def judge_engine(self, node: str, now: float) -> None:
        """Judge ``node``'s reading at ``now``, no read: gone stale, it leaves the signals."""
        self._tell_engine(self.engines.judge(node, now))

    def _tell_engine(self, change: EngineChange | None) -> None:
        if change is not None:
            self._tell(change)


def _keep_verdict(state: NodeState, verdict: CheckVerdict) -> None:
    """Keep what a finished check says of the node, beside its health and records."""
    state.last_outcome = f"check_{verdict.result}"
    if verdict.last_error is not None:
        state.last_error = verdict.last_error
