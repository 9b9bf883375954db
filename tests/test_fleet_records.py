"""core/fleet_records.py: the board's records through the one codec, both ways, table-tested."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from trio_failover.core import fleet_records
from trio_failover.core.affinity import Served
from trio_failover.core.engine_state import EngineRead
from trio_failover.core.engines import Detection, EngineKind, LoadedModel, ModelLoad, Signals
from trio_failover.core.fleet_records import (
    KINDS,
    Record,
    RemoteRecord,
    decode,
    decode_envelope,
    encode,
    encode_envelope,
    record_field,
)
from trio_failover.core.fleet_share import ClientShare, ShareSummary
from trio_failover.core.liveness import CheckRecord
from trio_failover.core.node_change import ChangeKind, InventoryChange, LastCheck, NodeChange

COOLING, UP, DOWN, READY = ChangeKind.COOLING, ChangeKind.UP, ChangeKind.DOWN, ChangeKind.READY
LLAMA = Detection(EngineKind.LLAMA_SERVER, "configured")
CHECK = CheckRecord("health", False, 503, "busy", at=96.0)
SIGNALS = Signals(
    busy=1,
    per_model={"m": ModelLoad(2, 1, 0.5)},
    loaded=frozenset({"b", "a"}),
    loaded_details=(LoadedModel("a", None, 7),),
)

# Every record type, written at 100.0 on one clock: (record, its hash field, its JSON).
TABLE: list[tuple[Record, str, dict[str, Any]]] = [
    (
        NodeChange(COOLING, "a", "timeout", 30.0),
        "readiness:cooldown",
        {
            "kind": "readiness",
            "key": "cooldown",
            "change": "cooling",
            "reason": "timeout",
            "remaining_s": 30.0,
            "model": None,
            "error": None,
        },
    ),
    (
        NodeChange(COOLING, "a", "timeout", 30.0004, "qwen"),
        "readiness:cooldown:qwen",
        {
            "kind": "readiness",
            "key": "cooldown:qwen",
            "change": "cooling",
            "reason": "timeout",
            "remaining_s": 30.0,  # seconds to the millisecond
            "model": "qwen",
            "error": None,
        },
    ),
    (
        NodeChange(READY, "a", "success"),
        "readiness:cooldown",
        {"change": "ready", "key": "cooldown", "remaining_s": 0.0},
    ),
    (NodeChange(ChangeKind.COOLED, "a", "expired"), "readiness:cooldown", {"change": "cooled"}),
    (
        NodeChange(DOWN, "a", "health_check", error="refused"),
        "readiness:down",
        {"change": "down", "key": "down", "error": "refused"},
    ),
    (NodeChange(UP, "a", "health_check", 5.0), "readiness:down", {"change": "up"}),
    (
        InventoryChange("a", ("m1", "m2")),
        "inventory",
        {"kind": "inventory", "models": ["m1", "m2"]},
    ),
    (InventoryChange("a", None), "inventory", {"kind": "inventory", "models": None}),
    (
        LastCheck("a", CHECK),
        "last_check",
        {
            "kind": "last_check",
            "check": "health",
            "ok": False,
            "status": 503,
            "error": "busy",
            "age_s": 4.0,  # its clock time as its age when written
        },
    ),
    (
        EngineRead("a", LLAMA, SIGNALS, at=99.75),
        "engine",
        {
            "kind": "engine",
            "engine": {"kind": "llama-server", "found_by": "configured"},
            "signals": {
                "busy": 1,
                "waiting": None,
                "total_slots": None,
                "kv_cache_usage": None,
                "per_model": {"m": {"running": 2, "waiting": 1, "kv_cache_usage": 0.5}},
                "loaded": ["a", "b"],
                "not_loaded": [],
                "loaded_is_complete": False,
                "loaded_details": [{"name": "a", "expires_at": None, "size_vram": 7}],
                "last_error": "",
            },
            "age_s": 0.25,
        },
    ),
    (
        Served("a", ("00112233445566ff", "8899aabbccddeeff")),
        "served",
        {"kind": "served", "chain": ["00112233445566ff", "8899aabbccddeeff"]},
    ),
    (
        ShareSummary((ClientShare("bob", 1, 3, 0, 0.5),)),
        "share",
        {
            "kind": "share",
            "clients": [{"client": "bob", "rank": 1, "waiting": 3, "running": 0, "use": 0.5}],
        },
    ),
]


def about(record: Record) -> str | None:
    """The node its envelope names: a replica's record (``share``) names none."""
    return None if isinstance(record, ShareSummary) else "a"


def test_the_table_has_every_kind() -> None:
    assert {type(record) for record, _, _ in TABLE} == {kind.type for kind in KINDS}


@pytest.mark.parametrize(("record", "field", "document"), TABLE)
def test_a_record_goes_and_comes_back_whole(
    record: Record, field: str, document: dict[str, Any]
) -> None:
    written = encode(record, now=100.0)
    assert written.items() >= document.items()
    assert record_field(written) == field
    remote = decode_envelope(encode_envelope("r2", about(record), written))
    assert remote == RemoteRecord("r2", about(record), written)
    # Read on the writer's clock, at once: the same record, with its origin.
    expected = attrs.evolve(record, origin="r2")
    if isinstance(record, NodeChange):
        expected = attrs.evolve(expected, remaining=round(record.remaining, 3))
    assert decode(remote, now=100.0) == expected


@pytest.mark.parametrize(("record", "field", "document"), TABLE)
def test_a_record_about_the_wrong_thing_is_none(
    record: Record, field: str, document: dict[str, Any]
) -> None:
    written = encode(record, now=100.0)
    wrong = "a" if about(record) is None else None
    assert decode(RemoteRecord("r2", wrong, written), 100.0) is None
    assert decode(RemoteRecord("r2", about(record), {**written, "kind": "other"}), 100.0) is None


# A record read later, on another clock: (record, seconds in Redis, the reader's now, read).
AGED = [
    # The cooldown runs on for what is left of it.
    (NodeChange(COOLING, "a", "t", 30.0), 10.0, 0.0, NodeChange(COOLING, "a", "t", 20.0)),
    # Ran out meanwhile: nothing to apply.
    (NodeChange(COOLING, "a", "t", 30.0), 31.0, 0.0, None),
    # Up while cooling, and the cooldown ran out since: ready.
    (NodeChange(UP, "a", "h", 5.0), 6.0, 0.0, NodeChange(READY, "a", "h", 0.0)),
    (NodeChange(DOWN, "a", "h", error="x"), 100.0, 0.0, NodeChange(DOWN, "a", "h", error="x")),
    # Four seconds old when written, two in Redis, read on a clock at 50: six seconds old.
    (LastCheck("a", CHECK), 2.0, 50.0, LastCheck("a", attrs.evolve(CHECK, at=44.0))),
    # 0.25 s old when written, 1.5 s in Redis.
    (
        EngineRead("a", LLAMA, SIGNALS, at=99.75),
        1.5,
        10.0,
        EngineRead("a", LLAMA, SIGNALS, at=8.25),
    ),
    (InventoryChange("a", ("m",)), 1e6, 0.0, InventoryChange("a", ("m",))),
]


@pytest.mark.parametrize(("record", "age", "now", "expected"), AGED)
def test_a_record_read_later_counts_its_age(
    record: Record, age: float, now: float, expected: Record | None
) -> None:
    remote = RemoteRecord("r2", "a", encode(record, 100.0), age)
    want = None if expected is None else attrs.evolve(expected, origin="r2")
    assert decode(remote, now) == want


@pytest.mark.parametrize(
    "record",
    [
        {"kind": "other"},
        {"kind": "readiness", "change": "melting", "reason": "x"},
        {"kind": "readiness", "reason": "x"},
        {"kind": "readiness", "change": "cooling", "reason": 3},
        {"kind": "readiness", "change": "cooling"},
        {"kind": "readiness", "change": "cooling", "reason": "x", "remaining_s": "long"},
        {"kind": "readiness", "change": "down", "reason": "x", "error": 5},
        {"kind": "readiness", "change": "down", "reason": "x", "model": ["m"]},
        {"kind": "inventory", "models": [1]},
        {"kind": "inventory", "models": "m"},
        {"kind": "last_check", "check": "health"},
        {"kind": "last_check", "ok": True},
        {"kind": "last_check", "check": "health", "ok": 1},
        {"kind": "last_check", "check": "health", "ok": True, "status": "200"},
        {"kind": "last_check", "check": "health", "ok": True, "error": 5},
        {"kind": "last_check", "check": "health", "ok": True, "age_s": "old"},
    ],
)
def test_what_is_not_a_whole_record_is_none(record: dict[str, Any]) -> None:
    assert decode(RemoteRecord("r2", "a", record), 0.0) is None


def test_a_field_left_out_is_its_default_and_one_not_known_is_ignored() -> None:
    remote = RemoteRecord("r2", "a", {"kind": "readiness", "change": "ready", "reason": "x"})
    assert decode(remote, 0.0) == NodeChange(READY, "a", "x", origin="r2")
    check = {"kind": "last_check", "check": "liveness", "ok": True, "status": None, "new": 1}
    assert decode(RemoteRecord("r2", "a", check), 5.0) == LastCheck(
        "a", CheckRecord("liveness", True, None, None, 5.0), "r2"
    )


def test_a_record_is_json_text_without_loss() -> None:
    for record, _, _ in TABLE:
        written = encode(record, 100.0)
        assert json.loads(json.dumps(written, allow_nan=False)) == written


def test_the_snapshot_is_applied_oldest_first() -> None:
    records = [RemoteRecord("r", "a", {"kind": k}, age) for k, age in (("x", 1.0), ("y", 5.0))]
    assert [r.record["kind"] for r in fleet_records.snapshot_order(records)] == ["y", "x"]


# -- the envelope and the snapshot ------------------------------------------------


def test_an_envelope_round_trips() -> None:
    record = {"kind": "cooldown", "remaining_s": 12.5, "models": ["a"]}
    data = encode_envelope("r1", "gpu-1", record)
    assert decode_envelope(data) == RemoteRecord(origin="r1", node="gpu-1", record=record)
    assert decode_envelope(encode_envelope("r1", None, {"kind": "x"}), 2.0) == RemoteRecord(
        origin="r1", node=None, record={"kind": "x"}, age=2.0
    )


@pytest.mark.parametrize(
    "record", [{}, {"kind": 1}, {"kind": "x", "at": object()}, {"kind": "x", "v": float("nan")}]
)
def test_a_record_without_a_kind_or_not_json_is_refused(record: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="record"):
        encode_envelope("r1", None, record)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff",
        b"[]",
        b'{"from": 1, "node": null, "record": {"kind": "x"}}',
        b'{"from": "a", "node": 2, "record": {"kind": "x"}}',
        b'{"from": "a", "node": null, "record": []}',
        b'{"from": "a", "node": null, "record": {"no": "kind"}}',
    ],
)
def test_what_is_not_our_envelope_is_none(data: bytes) -> None:
    assert decode_envelope(data) is None


def test_a_snapshot_ages_each_record_by_redis_clock() -> None:
    one = encode_envelope("a", "n1", {"kind": "cooldown"})
    two = encode_envelope("b", "n2", {"kind": "down"})
    reply = [
        10_000,
        [b"cooldown", b"7500 " + one, b"junk", b"no stamp", b"bad", b"9000 not json"],
        [],
        [b"down", b"10000 " + two],
    ]
    assert fleet_records.read_snapshot(reply) == [
        RemoteRecord(origin="a", node="n1", record={"kind": "cooldown"}, age=2.5),
        RemoteRecord(origin="b", node="n2", record={"kind": "down"}, age=0.0),
    ]


@pytest.mark.parametrize("reply", [None, [], [b"1"], [1, [b"odd"]], [1, b"x"]])
def test_a_snapshot_reply_not_of_our_script_raises(reply: object) -> None:
    with pytest.raises(ValueError, match="snapshot"):
        fleet_records.read_snapshot(reply)
