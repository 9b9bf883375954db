"""Pure: the node board's news as the records replicas share (SPEC 8).

Three kinds of record travel between replicas (``proxy/fleet.py`` sends
and applies them; ``core/state_layout.py`` carries them):

- ``readiness``: one ``NodeChange`` (cooling, ready, down, up, cooled),
  with the seconds its cooldown runs on from its making;
- ``inventory``: the models a node's last discovery check listed (``null``:
  it listed none it could tell);
- ``last_check``: the node's last finished check, as ``/status`` shows it.

Each has a ``key`` so that a node's hash keeps the latest of each part of
its state: a readiness record's key is ``cooldown`` (its cooldown, or a
model's: ``cooldown:MODEL``) or ``down`` (its down flag). A joining replica
applies the stored records oldest first (``snapshot_order``): played in
the order they happened, the two parts give the state they made.

Readers never raise: what is not a record of ours is None (a replica of
another version may send more kinds; they are skipped).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .liveness import CheckRecord
from .node_change import ChangeKind, NodeChange
from .state_layout import RemoteRecord

__all__ = [
    "change_record",
    "check_record",
    "inventory_record",
    "read_change",
    "read_check",
    "read_inventory",
    "snapshot_order",
]

READINESS, INVENTORY, LAST_CHECK = "readiness", "inventory", "last_check"

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
