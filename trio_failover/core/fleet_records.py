"""Pure: the node board's news as the records replicas share (docs/replicas.md).

Three kinds of record travel between replicas (``proxy/fleet/fleet.py`` sends
and applies them; ``core/state_layout.py`` carries them):

- ``readiness``: one ``NodeChange`` (cooling, ready, down, up, cooled),
  with the seconds its cooldown runs on from its making;
- ``inventory``: the models a node's last discovery check listed (``null``:
  it listed none it could tell);
- ``last_check``: the node's last finished check, as ``/status`` shows it;
- ``engine``: one good read of the node's engine (``EngineRead``), with the
  seconds since the read ended (``age_s``); its ``Signals`` and
  ``Detection`` in a JSON form of their own (``signals_json``,
  ``detection_json`` and their readers, which raise ``ValueError`` naming
  the field).

Each is kept in the node's hash by its kind (one ``engine`` record, the
latest), a readiness record also by its ``key``, so that the hash keeps
the latest of each part of the node's state: a readiness record's key is
``cooldown`` (its cooldown, or a model's: ``cooldown:MODEL``) or ``down``
(its down flag). A joining replica applies the stored records oldest first
(``snapshot_order``): played in the order they happened, the two parts
give the state they made.

The record readers never raise: what is not a record of ours is None (a replica of
another version may send more kinds; they are skipped).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from .engine_book import EngineRead
from .engines import Detection, EngineKind, LoadedModel, ModelLoad, Signals
from .liveness import CheckRecord
from .node_change import ChangeKind, NodeChange
from .state_layout import RemoteRecord

__all__ = [
    "change_record",
    "check_record",
    "detection_from_json",
    "detection_json",
    "engine_record",
    "inventory_record",
    "read_change",
    "read_check",
    "read_engine",
    "read_inventory",
    "signals_from_json",
    "signals_json",
    "snapshot_order",
]

READINESS, INVENTORY, LAST_CHECK, ENGINE = "readiness", "inventory", "last_check", "engine"

# The part of a node's state each kind of change sets (its record's key).
_PART = {
    ChangeKind.COOLING: "cooldown",
    ChangeKind.COOLED: "cooldown",
    ChangeKind.READY: "cooldown",  # clears the down flag too: played in order, it wins
    ChangeKind.DOWN: "down",
    ChangeKind.UP: "down",
}


def change_record(change: NodeChange) -> dict[str, Any]:
    """The record of ``change`` (``remaining_s``: from the moment it was applied)."""
    part = _PART[change.kind]
    key = part if change.model is None or part != "cooldown" else f"{part}:{change.model}"
    return {
        "kind": READINESS,
        "key": key,
        "change": change.kind.value,
        "reason": change.reason,
        "remaining_s": round(change.remaining, 3),
        "model": change.model,
        "error": change.error,
    }


def read_change(node: str | None, record: Mapping[str, Any], age: float) -> NodeChange | None:
    """The change a ``readiness`` record tells, ``age`` seconds after it was made.

    None when it is not one, or when it is a cooldown that ran out meanwhile
    (nothing left to apply: this replica's own ticker sees to expiries).
    """
    if record.get("kind") != READINESS or node is None:
        return None
    try:
        kind = ChangeKind(str(record.get("change")))
    except ValueError:
        return None
    reason, remaining = record.get("reason"), record.get("remaining_s", 0.0)
    model, error = record.get("model"), record.get("error")
    if not isinstance(reason, str) or type(remaining) not in (int, float):
        return None
    if not (model is None or isinstance(model, str)) or not (
        error is None or isinstance(error, str)
    ):
        return None
    left = max(0.0, float(remaining) - max(0.0, age))
    if kind is ChangeKind.COOLING and left <= 0:
        return None
    if kind is ChangeKind.UP and left <= 0:
        kind = ChangeKind.READY  # its cooldown ran out too: no longer demoted
    return NodeChange(kind, node, reason, left, model, error)


def inventory_record(inventory: tuple[str, ...] | None) -> dict[str, Any]:
    """The record of a node's inventory as its last discovery check replaced it."""
    return {"kind": INVENTORY, "models": None if inventory is None else list(inventory)}


def read_inventory(record: Mapping[str, Any]) -> tuple[bool, tuple[str, ...] | None]:
    """``(True, models)`` for an ``inventory`` record (None: unknown); else ``(False, None)``."""
    if record.get("kind") != INVENTORY:
        return False, None
    models = record.get("models")
    if models is None:
        return True, None
    if not isinstance(models, list) or not all(isinstance(name, str) for name in models):
        return False, None
    return True, tuple(models)


def check_record(check: CheckRecord, now: float) -> dict[str, Any]:
    """The record of a node's last finished check, ``now`` on the writer's clock."""
    shown = check.to_json(now)
    return {**shown, "kind": LAST_CHECK, "check": check.kind}


def read_check(record: Mapping[str, Any], age: float, now: float) -> CheckRecord | None:
    """The ``last_check`` record as a ``CheckRecord`` on this replica's clock (``now``)."""
    if record.get("kind") != LAST_CHECK:
        return None
    kind, ok, status = record.get("check"), record.get("ok"), record.get("status")
    error, check_age = record.get("error"), record.get("age_s", 0.0)
    if not isinstance(kind, str) or type(ok) is not bool:
        return None
    if not (status is None or type(status) is int) or not (error is None or isinstance(error, str)):
        return None
    if type(check_age) not in (int, float):
        return None
    return CheckRecord(kind, ok, status, error, now - max(0.0, age) - max(0.0, check_age))


def snapshot_order(records: Iterable[RemoteRecord]) -> list[RemoteRecord]:
    """The snapshot's records oldest first: the order to apply them in."""
    return sorted(records, key=lambda record: -record.age)


# -- engine reads ---------------------------------------------------------------


def engine_record(read: EngineRead) -> dict[str, Any]:
    """The record of one read of a node's engine (``age_s``: since the read ended)."""
    return {
        "kind": ENGINE,
        "engine": detection_json(read.engine),
        "signals": signals_json(read.signals),
        "age_s": round(read.age, 3),
    }


def read_engine(node: str | None, record: Mapping[str, Any], age: float) -> EngineRead | None:
    """The read an ``engine`` record tells, ``age`` seconds after it was written.

    None when it is not one, or not a whole one: a malformed part is never
    half applied. Its age is the record's ``age_s`` and ``age`` together.
    """
    if record.get("kind") != ENGINE or node is None:
        return None
    try:
        engine = detection_from_json(record.get("engine"))
        signals = signals_from_json(record.get("signals"))
        read_age = _number(record.get("age_s", 0.0), "age_s")
    except ValueError:
        return None
    return EngineRead(node, engine, signals, max(0.0, age) + read_age)


def detection_json(detection: Detection) -> dict[str, Any]:
    """A ``Detection`` as JSON: ``{"kind": "llama-server", "found_by": "configured"}``."""
    return {"kind": detection.kind.value, "found_by": detection.found_by}


def detection_from_json(document: object) -> Detection:
    """The ``Detection`` of ``detection_json``.

    Raises:
        ValueError: not one (the message names the field).
    """
    if not isinstance(document, dict):
        raise ValueError(f"engine: expected an object, got {document!r}")
    kind, found_by = document.get("kind"), document.get("found_by")
    try:
        engine = EngineKind(kind if isinstance(kind, str) else "")
    except ValueError:
        raise ValueError(f"engine.kind: not an engine kind: {kind!r}") from None
    if not isinstance(found_by, str):
        raise ValueError(f"engine.found_by: expected a string, got {found_by!r}")
    return Detection(engine, found_by)


def signals_json(signals: Signals) -> dict[str, Any]:
    """``Signals`` as JSON: every field, sets as sorted lists, records as objects."""
    return {
        "busy": signals.busy,
        "waiting": signals.waiting,
        "total_slots": signals.total_slots,
        "kv_cache_usage": signals.kv_cache_usage,
        "per_model": {
            name: {
                "running": load.running,
                "waiting": load.waiting,
                "kv_cache_usage": load.kv_cache_usage,
            }
            for name, load in sorted(signals.per_model.items())
        },
        "loaded": None if signals.loaded is None else sorted(signals.loaded),
        "not_loaded": sorted(signals.not_loaded),
        "loaded_is_complete": signals.loaded_is_complete,
        "loaded_details": [
            {"name": item.name, "expires_at": item.expires_at, "size_vram": item.size_vram}
            for item in signals.loaded_details
        ],
        "last_error": signals.last_error,
    }


def signals_from_json(document: object) -> Signals:
    """The ``Signals`` of ``signals_json``; a field left out is its default.

    Raises:
        ValueError: not an object, or a field of the wrong type (the message
            names it: ``signals.busy: expected a whole number >= 0 or null``).
    """
    if not isinstance(document, dict):
        raise ValueError(f"signals: expected an object, got {document!r}")
    per_model = document.get("per_model", {})
    if not isinstance(per_model, dict):
        raise ValueError(f"signals.per_model: expected an object, got {per_model!r}")
    loaded = document.get("loaded")
    details = document.get("loaded_details", [])
    if not isinstance(details, list):
        raise ValueError(f"signals.loaded_details: expected a list, got {details!r}")
    complete, error = document.get("loaded_is_complete", False), document.get("last_error", "")
    if type(complete) is not bool:
        raise ValueError(f"signals.loaded_is_complete: expected true or false, got {complete!r}")
    if not isinstance(error, str):
        raise ValueError(f"signals.last_error: expected a string, got {error!r}")
    return Signals(
        busy=_count(document.get("busy"), "signals.busy"),
        waiting=_count(document.get("waiting"), "signals.waiting"),
        total_slots=_count(document.get("total_slots"), "signals.total_slots"),
        kv_cache_usage=_fraction(document.get("kv_cache_usage"), "signals.kv_cache_usage"),
        per_model={
            _name(name, "signals.per_model"): _model_load(load, f"signals.per_model.{name}")
            for name, load in per_model.items()
        },
        loaded=None if loaded is None else frozenset(_names(loaded, "signals.loaded")),
        not_loaded=frozenset(_names(document.get("not_loaded", []), "signals.not_loaded")),
        loaded_is_complete=complete,
        loaded_details=tuple(_loaded_model(item) for item in details),
        last_error=error,
    )


def _model_load(document: object, where: str) -> ModelLoad:
    if not isinstance(document, dict):
        raise ValueError(f"{where}: expected an object, got {document!r}")
    return ModelLoad(
        _whole(document.get("running", 0), f"{where}.running"),
        _whole(document.get("waiting", 0), f"{where}.waiting"),
        _fraction(document.get("kv_cache_usage"), f"{where}.kv_cache_usage"),
    )


def _loaded_model(document: object) -> LoadedModel:
    where = "signals.loaded_details"
    if not isinstance(document, dict):
        raise ValueError(f"{where}: expected objects, got {document!r}")
    expires = document.get("expires_at")
    if not (expires is None or isinstance(expires, str)):
        raise ValueError(f"{where}.expires_at: expected a string or null, got {expires!r}")
    name = _name(document.get("name"), f"{where}.name")
    return LoadedModel(name, expires, _count(document.get("size_vram"), f"{where}.size_vram"))


def _count(value: object, where: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: expected a whole number >= 0 or null, got {value!r}")
    return value


def _whole(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: expected a whole number >= 0, got {value!r}")
    return value


def _fraction(value: object, where: str) -> float | None:
    return None if value is None else _number(value, where)


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _name(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {value!r}")
    return value


def _names(value: object, where: str) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of strings, got {value!r}")
    return [_name(name, where) for name in value]
