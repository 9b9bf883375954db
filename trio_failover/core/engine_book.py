"""Pure: every node's engine as last read, and what the slot decisions read of it.

The node board (``proxy/nodes/board.py``) owns one ``EngineBook`` and changes it
only through its engine verbs; the book folds each read into the
node's ``EngineState`` (``engine_state.next_state``) and keeps two outputs
current:

- ``signals``: node -> fresh ``Signals``, the very mapping the slot ledger
  reads (``SlotLedger.signals``); a reading that went stale leaves it at its
  node's next read, or when judged again (``judge``);
- ``EngineChange.capacity``: an ``auto`` node's capacity from its engine
  (``engine_state.auto_capacity``: llama-cpp-python's 1, llama-server's
  last ``total_slots``, which does not go stale, else 0); None for a
  configured one.

A read is a record, ``engine_state.EngineRead`` (node, engine, signals,
when, and which replica read it); ``EngineChange`` is what the board tells
its listeners after folding one, the read included. Times are float
seconds of the shell's clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .config import Config
from .engine_state import (
    EngineRead,
    EngineState,
    attempt_head_timeout,
    auto_capacity,
    loaded_nodes,
    next_state,
)
from .engines import (
    UNKNOWN,
    Detection,
    EngineKind,
    Signals,
    configured_engine,
    stale_after,
)

__all__ = ["EngineBook", "EngineChange", "EngineSettings", "engine_settings"]


@attrs.frozen
class EngineChange:
    """What a folded read left: the node's fresh signals and ``auto`` capacity.

    Attributes:
        node: the node read.
        signals: its current signals (``UNKNOWN`` when stale or none).
        capacity: its capacity from the engine if ``auto``; None if configured.
        changed: whether ``signals`` (what the ledger reads) changed.
        fresh: a good read, now the node's current signals: the ledger
            anchors it to this proxy's in-flight count of now
            (``SlotLedger.note_reading``).
        read: the read folded; None when a reading was judged again
            without one (``EngineBook.judge``).
    """

    node: str
    signals: Signals
    capacity: int | None
    changed: bool
    fresh: bool = False
    read: EngineRead | None = None


@attrs.frozen(kw_only=True)
class EngineSettings:
    """What the book needs of the configuration."""

    engines: Mapping[str, Detection | None] = attrs.field(factory=dict)  # None: auto
    auto: frozenset[str] = frozenset()  # the nodes of capacity ``auto``
    max_age: float = 0.0  # ``engines.stale_after``
    response_header_timeout: float = 0.0
    cold_start_timeout: float = 0.0


class EngineBook:
    """Each node's ``EngineState``, and the fresh signals the slot decisions read."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.states = {name: EngineState(engine=kind) for name, kind in settings.engines.items()}
        self.signals: dict[str, Signals] = {}  # the ledger reads this very dict

    def configure(self, settings: EngineSettings) -> None:
        """A reload's settings: added nodes start fresh, kept ones keep their readings.

        A removed node's reading goes (a name added again starts afresh).
        """
        self.settings = settings
        for name in [name for name in self.states if name not in settings.engines]:
            del self.states[name]
            self.signals.pop(name, None)
        for name, kind in settings.engines.items():
            if name not in self.states:
                self.states[name] = EngineState(engine=kind)

    def fold(self, read: EngineRead, now: float) -> EngineChange | None:
        """Fold one read into its node's state (None: a node the book does not have)."""
        node = read.node
        if node not in self.states:
            return None
        self.states[node] = next_state(self.states[node], read)
        return attrs.evolve(self._judged(node, now, read.at), read=read)

    def judge(self, node: str, now: float) -> EngineChange | None:
        """What ``node``'s reading is at ``now``, without a read (None: no such node).

        A reading that went stale since leaves ``signals``, as at a read: a
        replica fed by another's reads has no read of its own to
        drop it. Never ``fresh``.
        """
        if node not in self.states:
            return None
        return self._judged(node, now, None)

    def _judged(self, node: str, now: float, read_at: float | None) -> EngineChange:
        """Keep ``node``'s current signals at ``now``; ``read_at``: the read just folded."""
        state = self.states[node]
        current = state.current(now, self.settings.max_age)
        before = self.signals.get(node)
        if current == UNKNOWN:
            self.signals.pop(node, None)
        else:
            self.signals[node] = current
        capacity = auto_capacity(state).value if node in self.settings.auto else None
        # A good read of now (a failed one keeps the old reading and its anchor;
        # an older one changed nothing).
        fresh = read_at is not None and state.read_at == read_at and node in self.signals
        return EngineChange(node, current, capacity, before != self.signals.get(node), fresh)

    def describe(self, node: str, now: float) -> dict[str, Any]:
        """``/status``'s engine fields of ``node``: its kind, capacity source, last reading."""
        state = self.states[node]
        current = state.current(now, self.settings.max_age)
        source = auto_capacity(state).source if node in self.settings.auto else "configured"
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
        """The head deadline of an attempt at ``node`` for ``model``."""
        return attempt_head_timeout(
            self.signals.get(node),
            model,
            response_header_timeout=self.settings.response_header_timeout,
            cold_start_timeout=self.settings.cold_start_timeout,
        )

    def nodes(self) -> Iterable[str]:
        """The nodes the book has (configured now, or once)."""
        return self.states.keys()


def engine_settings(config: Config) -> EngineSettings:
    """The book's settings from a configuration."""
    return EngineSettings(
        engines={
            node.name: configured_engine(EngineKind(node.engine)) for node in config.upstreams
        },
        auto=frozenset(node.name for node in config.upstreams if node.capacity is None),
        max_age=stale_after(config.load_interval, config.discovery_interval),
        response_header_timeout=config.response_header_timeout,
        cold_start_timeout=config.cold_start_timeout,
    )
