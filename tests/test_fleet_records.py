"""core/fleet_records.py: the board's news as shared records, both ways, table-tested."""

from __future__ import annotations

from typing import Any

import pytest

from trio_failover.core import fleet_records
from trio_failover.core.liveness import CheckRecord
from trio_failover.core.node_change import ChangeKind, NodeChange
from trio_failover.core.state_layout import RemoteRecord, record_field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (NodeChange(ChangeKind.COOLING, "a", "timeout", 30.0), "readiness:cooldown"),
        (NodeChange(ChangeKind.COOLING, "a", "timeout", 30.0, "qwen"), "readiness:cooldown:qwen"),
        (NodeChange(ChangeKind.READY, "a", "success"), "readiness:cooldown"),
        (NodeChange(ChangeKind.COOLED, "a", "expired"), "readiness:cooldown"),
        (NodeChange(ChangeKind.DOWN, "a", "health_check", error="refused"), "readiness:down"),
        (NodeChange(ChangeKind.UP, "a", "health_check", 5.0), "readiness:down"),
    ],
)
def test_a_change_goes_and_comes_back_whole(change: NodeChange, field: str) -> None:
    record = fleet_records.change_record(change)
    assert record_field(record) == field
    assert fleet_records.read_change("a", record, 0.0) == change


COOLING, UP, DOWN, READY = ChangeKind.COOLING, ChangeKind.UP, ChangeKind.DOWN, ChangeKind.READY


@pytest.mark.parametrize(
    ("change", "age", "expected"),
    [
        # Aged: the cooldown runs on for what is left of it.
        (NodeChange(COOLING, "a", "t", 30.0), 10.0, NodeChange(COOLING, "a", "t", 20.0)),
        # Ran out meanwhile: nothing to apply.
        (NodeChange(COOLING, "a", "t", 30.0), 31.0, None),
        # Up while cooling, and the cooldown ran out since: ready.
        (NodeChange(UP, "a", "h", 5.0), 6.0, NodeChange(READY, "a", "h", 0.0)),
        (NodeChange(DOWN, "a", "h", error="x"), 100.0, NodeChange(DOWN, "a", "h", error="x")),
    ],
)
def test_a_change_read_later_counts_its_age(
    change: NodeChange, age: float, expected: NodeChange | None
) -> None:
    assert fleet_records.read_change("a", fleet_records.change_record(change), age) == expected


@pytest.mark.parametrize(
    "record",
    [
        {"kind": "other"},
        {"kind": "readiness", "change": "melting", "reason": "x"},
        {"kind": "readiness", "change": "cooling", "reason": 3},
        {"kind": "readiness", "change": "cooling", "reason": "x", "remaining_s": "long"},
        {"kind": "readiness", "change": "down", "reason": "x", "error": 5},
    ],
)
def test_what_is_not_a_change_is_none(record: dict[str, Any]) -> None:
    assert fleet_records.read_change("a", record, 0.0) is None
    ready = fleet_records.change_record(NodeChange(READY, "a", "x"))
    assert fleet_records.read_change(None, ready, 0.0) is None


def test_inventories_and_checks_go_and_come_back() -> None:
    assert fleet_records.read_inventory(fleet_records.inventory_record(("m1", "m2"))) == (
        True,
        ("m1", "m2"),
    )
    assert fleet_records.read_inventory(fleet_records.inventory_record(None)) == (True, None)
    assert fleet_records.read_inventory({"kind": "inventory", "models": [1]}) == (False, None)
    assert fleet_records.read_inventory({"kind": "last_check"}) == (False, None)
    check = CheckRecord("health", False, 503, "busy", at=100.0)
    record = fleet_records.check_record(check, now=104.0)  # four seconds old when written
    assert record_field(record) == "last_check"
    # Read two seconds later on a clock that reads 50: six seconds old.
    assert fleet_records.read_check(record, 2.0, now=50.0) == CheckRecord(
        "health", False, 503, "busy", at=44.0
    )
    assert fleet_records.read_check({"kind": "last_check", "check": "health"}, 0, 0) is None
    assert fleet_records.read_check({"kind": "inventory"}, 0, 0) is None


def test_the_snapshot_is_applied_oldest_first() -> None:
    records = [RemoteRecord("r", "a", {"kind": k}, age) for k, age in (("x", 1.0), ("y", 5.0))]
    assert [r.record["kind"] for r in fleet_records.snapshot_order(records)] == ["y", "x"]
