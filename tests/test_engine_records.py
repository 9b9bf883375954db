"""core/fleet_records.py: an engine read as a shared record, its signals field by field."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from trio_failover.core.engine_state import EngineRead
from trio_failover.core.engines import (
    UNKNOWN,
    Detection,
    EngineKind,
    LoadedModel,
    ModelLoad,
    Signals,
    failed,
)
from trio_failover.core.fleet_records import (
    RemoteRecord,
    decode,
    decode_envelope,
    encode,
    encode_envelope,
    read_value,
    record_field,
    value_json,
)

LLAMA = Detection(EngineKind.LLAMA_SERVER, "configured")
# Every field set to something other than its default.
EVERYTHING = Signals(
    busy=3,
    waiting=2,
    total_slots=4,
    kv_cache_usage=0.625,
    per_model={
        "qwen3": ModelLoad(running=2, waiting=1, kv_cache_usage=0.5),
        "llama3": ModelLoad(running=1),
    },
    loaded=frozenset({"qwen3:latest", "llama3:latest"}),
    not_loaded=frozenset({"phi4"}),
    loaded_is_complete=True,
    loaded_details=(
        LoadedModel("qwen3:latest", "2026-12-02T02:00:00Z", 4_000_000_000),
        LoadedModel("llama3:latest"),
    ),
    last_error="GET /slots: not JSON",
)


def test_every_field_of_signals_is_in_its_json_form() -> None:
    """A field added to ``Signals`` must be added to the record too (else it is lost on the way)."""
    assert set(value_json(UNKNOWN)) == {f.name for f in attrs.fields(Signals)}
    for field in attrs.fields(Signals):
        assert getattr(EVERYTHING, field.name) != getattr(UNKNOWN, field.name), field.name


@pytest.mark.parametrize(
    "signals",
    [
        pytest.param(UNKNOWN, id="nothing said"),
        pytest.param(EVERYTHING, id="every field"),
        pytest.param(Signals(busy=0, total_slots=1), id="llama-server, idle"),
        pytest.param(Signals(kv_cache_usage=0.0, waiting=0), id="vllm, zeros are not nulls"),
        pytest.param(Signals(loaded=frozenset()), id="ollama, nothing loaded (not unknown)"),
        pytest.param(failed("GET /props: connect timed out"), id="an error alone"),
    ],
)
def test_signals_go_and_come_back_whole_through_json_text(signals: Signals) -> None:
    text = json.dumps(value_json(signals), allow_nan=False)
    assert read_value(Signals, json.loads(text), "signals") == signals


@pytest.mark.parametrize(
    "detection",
    [LLAMA, Detection(EngineKind.OLLAMA, "GET /api/version"), Detection(EngineKind.VLLM, "")],
)
def test_a_detection_goes_and_comes_back(detection: Detection) -> None:
    document = json.loads(json.dumps(value_json(detection)))
    assert read_value(Detection, document, "engine") == detection


def test_an_engine_read_goes_through_an_envelope_and_comes_back_aged() -> None:
    read = EngineRead("gpu-1", LLAMA, EVERYTHING, at=9.75)
    record = encode(read, now=10.0)
    assert record_field(record) == "engine"  # one per node's hash: the latest replaces it
    remote = decode_envelope(encode_envelope("replica-a", "gpu-1", record), age=1.5)
    assert remote is not None
    # Its age: the 0.25 s it had when written and the 1.5 s it lay in Redis.
    expected = attrs.evolve(read, at=100.0 - 1.75, origin="replica-a")
    assert decode(remote, now=100.0) == expected


def test_a_field_left_out_is_its_default() -> None:
    assert read_value(Signals, {}, "signals") == UNKNOWN
    assert read_value(Signals, {"busy": 1}, "signals") == Signals(busy=1)
    assert read_value(Signals, {"per_model": {"m": {}}}, "signals") == Signals(
        per_model={"m": ModelLoad()}
    )


def signals_with(**fields: Any) -> dict[str, Any]:
    return {**value_json(EVERYTHING), **fields}


@pytest.mark.parametrize(
    ("document", "names"),
    [
        ([1, 2], "signals: expected an object"),
        (signals_with(busy="3"), "signals.busy"),
        (signals_with(busy=True), "signals.busy"),  # JSON's booleans are not numbers
        (signals_with(busy=-1), "signals.busy"),
        (signals_with(waiting=1.5), "signals.waiting"),
        (signals_with(total_slots=[4]), "signals.total_slots"),
        (signals_with(kv_cache_usage="half"), "signals.kv_cache_usage"),
        (signals_with(kv_cache_usage=float("nan")), "signals.kv_cache_usage"),
        (signals_with(kv_cache_usage=-0.5), "signals.kv_cache_usage"),
        (signals_with(per_model=[]), "signals.per_model"),
        (signals_with(per_model={"m": 3}), "signals.per_model.m"),
        (signals_with(per_model={"m": {"running": None}}), "signals.per_model.m.running"),
        (signals_with(per_model={"m": {"waiting": "x"}}), "signals.per_model.m.waiting"),
        (signals_with(per_model={"m": {"kv_cache_usage": {}}}), "signals.per_model.m.kv_cache"),
        (signals_with(loaded="qwen3"), "signals.loaded"),
        (signals_with(loaded=["qwen3", 7]), "signals.loaded"),
        (signals_with(not_loaded=None), "signals.not_loaded"),
        (signals_with(loaded_is_complete=1), "signals.loaded_is_complete"),
        (signals_with(loaded_details={}), "signals.loaded_details"),
        (signals_with(loaded_details=["qwen3"]), "signals.loaded_details"),
        (signals_with(loaded_details=[{"name": None}]), "signals.loaded_details.name"),
        (signals_with(loaded_details=[{"name": "m", "expires_at": 5}]), "details.expires_at"),
        (signals_with(loaded_details=[{"name": "m", "size_vram": -1}]), "details.size_vram"),
        (signals_with(last_error=None), "signals.last_error"),
    ],
)
def test_malformed_signals_are_a_clear_error(document: object, names: str) -> None:
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        read_value(Signals, document, "signals")


@pytest.mark.parametrize(
    ("document", "names"),
    [
        ("llama-server", "engine: expected an object"),
        ({"kind": "tgi", "found_by": "configured"}, "engine.kind"),
        ({"kind": None, "found_by": "configured"}, "engine.kind"),
        ({"kind": "vllm"}, "engine.found_by"),
    ],
)
def test_a_malformed_detection_is_a_clear_error(document: object, names: str) -> None:
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        read_value(Detection, document, "engine")


GOOD_RECORD = encode(EngineRead("a", LLAMA, Signals(busy=1), at=0.0), now=0.0)


@pytest.mark.parametrize(
    "record",
    [
        {"kind": "readiness"},
        {**GOOD_RECORD, "kind": "engines"},
        {**GOOD_RECORD, "engine": None},
        {**GOOD_RECORD, "signals": None},
        {**GOOD_RECORD, "signals": {"busy": "many"}},
        {**GOOD_RECORD, "age_s": "old"},
        {**GOOD_RECORD, "age_s": -1.0},
        {**GOOD_RECORD, "age_s": float("inf")},
    ],
)
def test_what_is_not_a_whole_engine_record_is_none(record: dict[str, Any]) -> None:
    assert decode(RemoteRecord("r2", "a", record), 0.0) is None


def test_an_engine_record_of_no_node_is_none_and_a_good_one_is_not() -> None:
    assert decode(RemoteRecord("r2", None, GOOD_RECORD), 0.0) is None
    assert decode(RemoteRecord("r2", "a", GOOD_RECORD), 5.0) == EngineRead(
        "a", LLAMA, Signals(busy=1), 5.0, "r2"
    )
