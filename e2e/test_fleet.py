"""Scenario 6: capacity and inventories on real engines (issues 17 and 18)."""

from __future__ import annotations

import json

import pytest
from conftest import Fleet
from harness import (
    CONTEXT,
    Exchange,
    chat_body,
    http_get,
    request_id,
    seconds_per_token,
    tokens_lasting,
    wait_for,
)

CHAT = "/v1/chat/completions"
STREAM_S = 5.0  # a stream of the capacity-two test, alone, at the engine's measured speed


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
def test_capacity_one_puts_two_streams_on_two_engines(fleet: Fleet, kind: str) -> None:
    a, b = fleet.engines(kind, "a", "b")  # one slot each
    proxy = fleet.proxy([("a", a.url), ("b", b.url)], "--capacity", "1")
    streams = [Exchange.post(proxy.port, CHAT, chat_body(24)) for _ in range(2)]
    for stream in streams:
        stream.read_all()
    for stream in streams:
        assert stream.status == 200
        assert stream.complete
        assert stream.events()[-1].data == "[DONE]"
    assert {s.response_headers["x-failover-node"] for s in streams} == {"a", "b"}


def test_capacity_two_keeps_both_slots_of_one_engine_busy(fleet: Fleet) -> None:
    (engine,) = fleet.engines("llama-server", "a", parallel=2)
    # Each stream lasts some seconds at the speed measured here (longer with
    # two sharing the engine's thread): time to see both slots busy.
    max_tokens = tokens_lasting(STREAM_S, seconds_per_token(engine.port), CONTEXT - 64)
    proxy = fleet.proxy([("a", engine.url)], "--capacity", "2")
    streams = [
        Exchange.post(proxy.port, CHAT, chat_body(max_tokens), timeout=120) for _ in range(3)
    ]

    def two_busy_one_queued() -> bool:
        busy = sum(1 for slot in engine.slots() if slot["is_processing"])  # type: ignore[attr-defined]
        return busy == 2 and proxy.status()["queued"] == 1

    wait_for(two_busy_one_queued, 10, what="two busy slots and one queued workload")
    for stream in streams:
        stream.read_all()
        assert stream.status == 200
        assert stream.complete


def test_models_list_merges_two_engines(fleet: Fleet) -> None:
    (server,) = fleet.engines("llama-server", "a", alias="tiny-a")
    (python,) = fleet.engines("llama-cpp-python", "b", alias="tiny-b")
    proxy = fleet.proxy([("a", server.url), ("b", python.url)])
    status, _, body = http_get(proxy.port, "/v1/models", {"X-Request-Id": request_id()})
    assert status == 200, body[:300]
    models = {model["id"]: model for model in json.loads(body)["data"]}
    assert set(models) == {"tiny-a", "tiny-b"}
    assert models["tiny-a"]["nodes"] == ["a"]
    assert models["tiny-b"]["nodes"] == ["b"]
