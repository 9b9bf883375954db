"""A temporary home for the engines' signals until the node board owns them (SPEC 5c).

``EngineHolder.on_signal`` is the reader's one callback. It folds each read
into the node's ``EngineState`` (``core/engine_state.py``) and keeps two
things current for the slot decisions:

- ``signals``: node -> fresh ``Signals``, the very mapping the slot ledger
  reads (``SlotLedger.signals``): full by either count, ``least-loaded``'s
  key. A reading that went stale leaves it at the next read of its node.
  Each good read is anchored in the ledger (``SlotLedger.note_reading``),
  which then moves the engine's count by this proxy's own takes and
  releases until the next one.
- the capacity of every ``auto`` node in the ledger
  (``engine_state.auto_capacity``: llama-server's ``total_slots``, else 0).

After a change it dispatches the queue: a node that the engine's count made
full may be free now. The request path asks ``loaded`` (loaded models
first) and ``head_timeout`` (the cold-start deadline).

All of it is one object on the proxy (``Proxy.engines``), so the board can
take it over whole: its state is ``states``, its outputs the ledger's
``signals`` and capacities.
"""

from __future__ import annotations

from typing import Any

import trio

from ..core.config import Config
from ..core.engine_state import (
    EngineSignal,
    EngineState,
    attempt_head_timeout,
    auto_capacity,
    loaded_nodes,
    next_state,
)
from ..core.engines import (
    UNKNOWN,
    EngineKind,
    Signals,
    configured_engine,
    resolve_capacity,
    stale_after,
)
from .queue import SlotQueue


class EngineHolder:
    """Each node's engine state, and what the slot decisions read of it."""

    def __init__(self, config: Config, queue: SlotQueue) -> None:
        self.config = config
        self.queue = queue
        self.max_age = stale_after(config.load_interval, config.discovery_interval)
        self.states = {
            node.name: EngineState(engine=configured_engine(EngineKind(node.engine)))
            for node in config.upstreams
        }
        self._auto = {node.name for node in config.upstreams if node.capacity is None}
        # The ledger reads this very dict: empty until an engine says something.
        self.signals: dict[str, Signals] = {}
        queue.scheduler.ledger.signals = self.signals

    def reconcile(self, config: Config) -> None:
        """A reload: fresh state for added nodes; kept nodes keep their readings."""
        self.config = config
        self.max_age = stale_after(config.load_interval, config.discovery_interval)
        for node in config.upstreams:
            if node.name not in self.states:
                self.states[node.name] = EngineState(
                    engine=configured_engine(EngineKind(node.engine))
                )
        self._auto = {node.name for node in config.upstreams if node.capacity is None}

    def on_signal(self, node: str, signal: EngineSignal) -> None:
        """The reader's callback: one read of ``node``'s engine."""
        if node not in self.states:
            return
        state = self.states[node] = next_state(self.states[node], signal)
        current = state.current(trio.current_time(), self.max_age)
        changed = self._set_signals(node, current)
        if state.read_at == signal.at and node in self.signals:
            # A good read: the engine's count is of now, this proxy's
            # attempts of now among it (a failed read keeps the old anchor).
            self.queue.scheduler.ledger.note_reading(node)
            changed = True
        if node in self._auto:
            changed |= self.queue.scheduler.ledger.set_capacity(node, auto_capacity(current))
        if changed:
            self.queue.dispatch()

    def _set_signals(self, node: str, current: Signals) -> bool:
        before = self.signals.get(node)
        if current == UNKNOWN:
            self.signals.pop(node, None)
        else:
            self.signals[node] = current
        return before != self.signals.get(node)

    def describe(self, node: str, now: float) -> dict[str, Any]:
        """``/status``'s engine fields of ``node``: its kind, capacity source, last reading."""
        state = self.states[node]
        current = state.current(now, self.max_age)
        if node not in self._auto:
            source = "configured"
        else:
            source = resolve_capacity(None, "", current.total_slots).source
        engine = state.engine
        return {
            "engine": None
            if engine is None
            else {"kind": engine.kind.value, "found_by": engine.found_by},
            "capacity_source": source,
            "engine_signals": None
            if state.read_at is None
            else {
                "busy": current.busy,
                "waiting": current.waiting,
                "total_slots": current.total_slots,
                "kv_cache_usage": current.kv_cache_usage,
                "loaded": None if current.loaded is None else sorted(current.loaded),
                "age_s": round(now - state.read_at, 3),
                "stale": current == UNKNOWN,
            },
            "engine_error": state.last_error or None,
        }

    def loaded(self, model: str | None) -> frozenset[str]:
        """The nodes holding ``model`` loaded now (``SlotQueue.acquire``'s ``loaded``)."""
        return loaded_nodes(model, self.signals)

    def head_timeout(self, node: str, model: str | None) -> float:
        """The head deadline of an attempt at ``node`` for ``model`` (SPEC 5c)."""
        return attempt_head_timeout(
            self.signals.get(node),
            model,
            response_header_timeout=self.config.response_header_timeout,
            cold_start_timeout=self.config.cold_start_timeout,
        )
