"""Pure: what the proxy keeps of each node's engine between reads (docs/engines.md).

The reader (``proxy/nodes/engine_reader.py``) hands over one ``EngineRead`` per
read: the node, its engine kind, the parsed ``Signals`` and the time of the
read (another replica's reads arrive as the same record, with their
``origin``). Whoever owns node state (the node board) folds it into that node's
``EngineState`` with ``next_state`` and asks ``EngineState.current`` when it
decides: a reading older than three intervals is unknown, and unknown limits
nothing (but the capacity, which does not go stale: ``auto_capacity``).
The decisions the current signals feed are in ``engines.py``
(``resolve_capacity``, ``model_loaded``, ``head_timeout``); ``auto_capacity``, ``loaded_nodes`` and
``attempt_head_timeout`` here apply them to a node's state.

Times are float seconds of the shell's clock.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .engines import (
    UNKNOWN,
    Capacity,
    Detection,
    Signals,
    current_signals,
    head_timeout,
    merge_signals,
    model_loaded,
    resolve_capacity,
)

__all__ = [
    "EngineRead",
    "EngineState",
    "attempt_head_timeout",
    "auto_capacity",
    "loaded_nodes",
    "next_state",
]


@attrs.frozen
class EngineRead:
    """One read of one node's engine: the reader's, or another replica's.

    A record of the node board (``NodeBoard.apply``); it travels between
    replicas as an ``engine`` record (``core/fleet_records.py``), its
    clock time as an age.

    Attributes:
        node: the node read.
        engine: the node's engine kind and how it was found (configured, or
            detected at its first good check).
        signals: what the read gave; ``last_error`` says why any part of it
            failed (a read that failed whole has nothing else set).
        at: when the read ended (the Trio clock of this process).
        origin: the replica that read it; None: this one.
    """

    node: str
    engine: Detection
    signals: Signals
    at: float
    origin: str | None = None


@attrs.frozen(kw_only=True)
class EngineState:
    """One node's engine as last read.

    Attributes:
        engine: its kind; None while an ``auto`` node waits for detection.
        signals: the last good reading (with the fields of later partial
            ones laid over it), its ``last_error`` cleared.
        read_at: when ``signals`` was read whole; None = never.
        last_error: why the latest read failed, "" when it did not.
        error_at: when it failed; None = never.
    """

    engine: Detection | None = None
    signals: Signals = UNKNOWN
    read_at: float | None = None
    last_error: str = ""
    error_at: float | None = None

    def current(self, now: float, max_age: float) -> Signals:
        """The signals if they are fresh at ``now`` (``max_age``: ``stale_after``), else UNKNOWN."""
        return current_signals(self.signals, self.read_at, now, max_age)


def next_state(state: EngineState, signal: EngineRead) -> EngineState:
    """Fold one read into a node's state.

    A good read replaces the signals and dates them. A read with an error
    keeps the last good signals and their date, so they go stale on their
    own schedule (three intervals after the last good read), and lays any
    field the read did give (llama-server's ``/props`` when its ``/slots``
    failed) over them.

    A good read older than the state's (another replica's, come late)
    changes nothing: the newest reading wins, whoever took it.
    """
    error = signal.signals.last_error
    if not error:
        if state.read_at is not None and signal.at < state.read_at:
            return state
        return EngineState(engine=signal.engine, signals=signal.signals, read_at=signal.at)
    partial = attrs.evolve(signal.signals, last_error="")
    signals = merge_signals([state.signals, partial]) if partial != UNKNOWN else state.signals
    return EngineState(
        engine=signal.engine,
        signals=attrs.evolve(signals, last_error=""),
        read_at=state.read_at,
        last_error=error,
        error_at=signal.at,
    )


def auto_capacity(state: EngineState) -> Capacity:
    """Capacity ``auto`` of a node: its engine kind's own, else its last ``total_slots``.

    Read from the last reading, fresh or not: a node's capacity is not a
    signal that goes stale. The last ``total_slots`` holds until the engine
    says another number (a frozen engine's slots do not vanish, and a node
    full by this proxy's own count stays full); its busy count goes stale
    as before (``EngineState.current``).
    """
    kind = None if state.engine is None else state.engine.kind
    return resolve_capacity(None, "", state.signals.total_slots, kind=kind)


def loaded_nodes(model: str | None, signals: Mapping[str, Signals]) -> frozenset[str]:
    """The nodes whose engine holds ``model`` loaded now (``choose_node``'s ``loaded``).

    Empty for a request that names no model, and wherever nobody says.
    """
    if model is None or not signals:
        return frozenset()
    return frozenset(node for node, read in signals.items() if model_loaded(read, model) is True)


def attempt_head_timeout(
    signals: Signals | None,
    model: str | None,
    *,
    response_header_timeout: float,
    cold_start_timeout: float,
) -> float:
    """The head deadline of one attempt: the cold-start timeout for a model known not loaded."""
    loaded = None if signals is None or model is None else model_loaded(signals, model)
    return head_timeout(
        loaded,
        response_header_timeout=response_header_timeout,
        cold_start_timeout=cold_start_timeout,
    )
