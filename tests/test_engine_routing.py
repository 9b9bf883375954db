"""Engine signals in the proxy's decisions, whole proxy under MockClock with fake engines.

Discovery and the engine reader run as ``serve()`` runs them; the fake
engines keep their own slots and loaded models and answer the reads from
them. Capacity ``auto`` comes from llama-server's ``/props``; work sent
straight to an engine counts through its ``/slots``; Ollama's ``/api/ps``
puts a node with the model loaded first and gives a node that must load it
the cold-start timeout.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_failover import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    ClientResponse,
    FakeLlamaCppPython,
    FakeLlamaServer,
    FakeLmStudio,
    FakeNode,
    FakeOllama,
    FakeVllm,
    Fleet,
    NodeIO,
    ReceivedRequest,
    request,
)

LIMIT = 3600.0


def stream_of(model: str) -> bytes:
    return json.dumps({"model": model, "stream": True, "messages": []}).encode()


@asynccontextmanager
async def running(
    fleet: Fleet, upstreams: list[Upstream] | None = None, **settings: Any
) -> AsyncIterator[Proxy]:
    """A proxy over ``fleet`` with its checks and engine reads running, as ``serve()`` has them."""
    config = Config(upstreams=upstreams or fleet.upstreams(), admin_listen=None, **settings)
    async with Proxy(config, connector=fleet.connector) as proxy:  # checks and reads run
        await trio.sleep(1.0)  # every node's first check, detection and read are done
        yield proxy


async def together(proxy: Proxy, bodies: list[bytes]) -> list[ClientResponse]:
    """Send ``bodies`` at once; the responses in sending order."""
    responses: dict[int, ClientResponse] = {}

    async def one(index: int, body: bytes) -> None:
        response = await request(proxy, body=body)
        assert response is not None
        responses[index] = response

    async with trio.open_nursery() as nursery:
        for index, body in enumerate(bodies):
            nursery.start_soon(one, index, body)
    return [responses[index] for index in range(len(bodies))]


def node_of(response: ClientResponse) -> str | None:
    return response.header("x-failover-node")


def capacities(proxy: Proxy) -> Mapping[str, object]:
    return {node["name"]: node["capacity"] for node in proxy.status()["nodes"]}


async def test_capacity_auto_from_props_puts_two_streams_on_each_engine(
    autojump_clock: trio.abc.Clock,
) -> None:
    engines = {name: FakeLlamaServer(slots=2, tokens=5, token_delay=1.0) for name in "ab"}
    async with Fleet({name: FakeNode(e) for name, e in engines.items()}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:  # no --capacity: auto
                assert capacities(proxy) == {"a": 2, "b": 2}
                started = trio.current_time()
                responses = await together(proxy, [stream_of("tiny")] * 4)
                took = trio.current_time() - started
    assert sorted(node_of(r) or "" for r in responses) == ["a", "a", "b", "b"]
    assert all(r.status == 200 for r in responses)
    assert took == 5.0  # five tokens a second apart: nobody waited inside an engine
    assert [len(e.served) for e in engines.values()] == [2, 2]


async def test_a_slot_freed_after_a_reading_that_showed_the_engine_full_is_used_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A burst: each reading during it shows every slot busy, with this proxy's own work.

    Were the reading the last word until the next one, each freed slot
    would idle until then (a load interval, 2 s): the burst takes longer
    than its rounds of service. Moved by the proxy's own releases, the
    next waiter takes the slot as it frees.
    """
    engines = {name: FakeLlamaServer(slots=2, tokens=3, token_delay=1.0) for name in "ab"}
    async with Fleet({name: FakeNode(e) for name, e in engines.items()}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:  # no --capacity: auto, 2 each
                started = trio.current_time()
                responses = await together(proxy, [stream_of("tiny")] * 12)
                took = trio.current_time() - started
    assert all(r.status == 200 for r in responses)
    assert sorted(node_of(r) or "" for r in responses) == ["a"] * 6 + ["b"] * 6
    assert took == 9.0  # three rounds of 3 s on four slots, not a second lost between them


async def test_a_configured_capacity_wins_over_the_engines(
    autojump_clock: trio.abc.Clock,
) -> None:
    engines = {name: FakeLlamaServer(slots=2) for name in "ab"}
    async with Fleet({name: FakeNode(e) for name, e in engines.items()}) as fleet:
        upstreams = fleet.upstreams()
        upstreams[0] = attrs.evolve(upstreams[0], capacity=1)
        with trio.fail_after(LIMIT):
            async with running(fleet, upstreams) as proxy:
                assert capacities(proxy) == {"a": 1, "b": 2}


async def test_work_sent_straight_to_an_engine_sends_the_next_request_to_the_other(
    autojump_clock: trio.abc.Clock,
) -> None:
    engines = {name: FakeLlamaServer(slots=2, tokens=3, token_delay=1.0) for name in "ab"}
    async with Fleet({name: FakeNode(e) for name, e in engines.items()}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                engines["a"].set_other_clients(2)  # two streams past the proxy
                await trio.sleep(2.0)  # a's next /slots says both busy
                started = trio.current_time()
                response = await request(proxy, body=stream_of("tiny"))
                took = trio.current_time() - started
                engines["a"].set_other_clients(0)
    assert response is not None
    assert response.status == 200
    # By the proxy's own count a is free and first; sent there, the request
    # would wait inside it, headless, until the header timeout.
    assert node_of(response) == "b"
    assert took == 3.0
    assert not [r for r in fleet["a"].received if r.method == b"POST"]


def cold_and_warm() -> tuple[FakeOllama, FakeOllama]:
    """Two Ollamas serving qwen3: the first must load it (30 s), the second holds it loaded."""
    cold = FakeOllama(models=["qwen3:latest"], load_delay=30.0)
    warm = FakeOllama(models=["qwen3:latest"], loaded=["qwen3:latest"], load_delay=30.0)
    return cold, warm


async def test_an_ollama_node_with_the_model_loaded_wins_over_one_without(
    autojump_clock: trio.abc.Clock,
) -> None:
    cold, warm = cold_and_warm()
    async with Fleet({"cold": FakeNode(cold), "warm": FakeNode(warm)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                started = trio.current_time()
                response = await request(proxy, body=stream_of("qwen3"))
                took = trio.current_time() - started
    assert response is not None
    assert node_of(response) == "warm"
    assert took < 1.0
    assert (cold.loads, warm.loads) == ([], [])


async def test_x_failover_node_stands_before_a_node_with_the_model_loaded(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The client's choice is served, with the cold start, while it has a free slot."""
    cold, warm = cold_and_warm()
    async with Fleet({"cold": FakeNode(cold), "warm": FakeNode(warm)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                body = stream_of("qwen3")
                pinned = await request(proxy, body=body, headers=[("x-failover-node", "cold")])
                unpinned = await request(proxy, body=body)
    assert pinned is not None
    assert unpinned is not None
    assert (node_of(pinned), node_of(unpinned)) == ("cold", "warm")
    assert (cold.loads, warm.loads) == (["qwen3:latest"], [])


async def test_a_cold_load_within_the_cold_start_timeout_is_served_and_demotes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    first = FakeOllama(models=["qwen3:latest"], load_delay=150.0)
    second = FakeOllama(models=["qwen3:latest"], load_delay=150.0)
    async with Fleet({"a": FakeNode(first), "b": FakeNode(second)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet, response_header_timeout=120.0) as proxy:
                started = trio.current_time()
                response = await request(proxy, body=stream_of("qwen3"))
                took = trio.current_time() - started
                states = {node["name"]: node["state"] for node in proxy.status()["nodes"]}
    assert response is not None
    assert response.status == 200
    assert node_of(response) == "a"
    assert took == 150.0  # the load, past the 120 s header timeout, within the 5 m cold start
    assert (first.loads, second.loads) == (["qwen3:latest"], [])
    assert states == {"a": "ready", "b": "ready"}


async def test_without_engine_reads_a_cold_load_is_a_header_timeout_as_before(
    autojump_clock: trio.abc.Clock,
) -> None:
    first = FakeOllama(models=["qwen3:latest"], load_delay=150.0)
    second = FakeOllama(models=["qwen3:latest"], loaded=["qwen3:latest"])
    async with Fleet({"a": FakeNode(first), "b": FakeNode(second)}) as fleet:
        config = Config(upstreams=fleet.upstreams(), admin_listen=None)
        proxy = Proxy(config, connector=fleet.connector)  # no reader running
        with trio.fail_after(LIMIT):
            started = trio.current_time()
            response = await request(proxy, body=stream_of("qwen3"))
            took = trio.current_time() - started
    assert response is not None
    assert node_of(response) == "b"
    assert took == 120.0


async def test_status_shows_the_engine_the_capacity_source_and_the_reading(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeLlamaServer(slots=2)
    async with Fleet({"a": FakeNode(engine)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                engine.set_other_clients(1)
                await trio.sleep(2.0)
                [node] = proxy.status()["nodes"]
    assert node["engine"] == {"kind": "llama-server", "found_by": "GET /props: total_slots"}
    assert (node["capacity"], node["capacity_source"]) == (2, "auto (GET /props total_slots)")
    signals = node["engine_signals"]
    assert (signals["busy"], signals["total_slots"], signals["stale"]) == (1, 2, False)
    assert node["engine_error"] is None


async def test_the_engine_gauges_show_its_counts_and_the_capacity_in_force(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeLlamaServer(slots=3)
    async with Fleet({"a": FakeNode(engine)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                engine.set_other_clients(2)
                await trio.sleep(2.0)
                sample = proxy.metrics.registry.get_sample_value
                got = [
                    sample(name, {"node": "a"})
                    for name in ("trio_failover_capacity", "trio_failover_engine_busy")
                ]
                waiting = sample("trio_failover_engine_waiting", {"node": "a"})
    assert got == [3.0, 2.0]
    assert waiting is not None
    assert math.isnan(waiting)  # llama-server says none


async def test_vllm_running_and_waiting_count_for_least_loaded(
    autojump_clock: trio.abc.Clock,
) -> None:
    engines = {name: FakeVllm(slots=4, tokens=2, token_delay=1.0) for name in "ab"}
    async with Fleet({name: FakeNode(e) for name, e in engines.items()}) as fleet:
        upstreams = [attrs.evolve(node, capacity=4) for node in fleet.upstreams()]
        with trio.fail_after(LIMIT):
            async with running(fleet, upstreams, balance="least-loaded") as proxy:
                engines["a"].set_other_clients(1)  # one request past the proxy
                await trio.sleep(2.0)
                response = await request(proxy, body=stream_of("fake-model"))
    assert response is not None
    assert node_of(response) == "b"  # a: (max(0, 1) + 0) / 4; b: 0 / 4


async def test_an_lmstudio_node_with_the_model_loaded_wins(autojump_clock: trio.abc.Clock) -> None:
    cold = FakeLmStudio(models=["m"], load_delay=30.0)
    warm = FakeLmStudio(models=["m"], loaded=["m"], load_delay=30.0)
    async with Fleet({"cold": FakeNode(cold), "warm": FakeNode(warm)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                response = await request(proxy, body=stream_of("m"))
                [first, _] = proxy.status()["nodes"]
    assert response is not None
    assert node_of(response) == "warm"
    assert first["engine"] == {
        "kind": "lmstudio",
        "found_by": "GET /api/v0/models: state per model",
    }
    assert (cold.loads, warm.loads) == ([], [])


# -- the engines' own context-length answers fail over (--retry-error-codes) -------------


def long_chat(words: int) -> bytes:
    """A streamed chat whose prompt is ``words`` of the fakes' tokens."""
    content = " ".join(["word"] * words)
    body = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": content}]}
    return json.dumps(body).encode()


def outcomes(proxy: Proxy) -> list[list[tuple[str, str]]]:
    return [[(a["node"], a["outcome"]) for a in w["attempts"]] for w in proxy.recent]


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(FakeLlamaServer, id="llama-server"),  # 400 exceed_context_size_error
        pytest.param(FakeVllm, id="vllm"),  # 400 "This model's maximum context length is"
        pytest.param(FakeLlamaCppPython, id="llama-cpp-python"),  # code context_length_exceeded
    ],
)
async def test_a_prompt_over_the_first_engines_context_fails_over_to_one_it_fits(
    autojump_clock: trio.abc.Clock, engine: Any
) -> None:
    small, big = engine(context=100), engine(context=4096)
    async with Fleet({"small": FakeNode(small), "big": FakeNode(big)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:  # the default --retry-error-codes
                started = trio.current_time()
                response = await request(proxy, body=long_chat(500))
                took = trio.current_time() - started
                done = outcomes(proxy)
    assert response is not None
    assert (response.status, node_of(response)) == (200, "big")
    assert response.header("x-failover-attempts") == "2"
    assert done == [[("small", "retryable_response"), ("big", "completed")]]
    assert (small.too_long, big.too_long, big.served) == (1, 0, ["tiny"])
    assert took == 0.0  # no cooldown, no deadline: the next node at once
    # Retryable, so not demoted: the next request that fits goes to small.
    states = {node["name"]: node["state"] for node in proxy.status()["nodes"]}
    assert states == {"small": "ready", "big": "ready"}


# -- llama-cpp-python: capacity 1, found from the check's own answer ------------------------


async def test_llama_cpp_python_is_found_from_the_checks_model_list_and_asked_nothing_more(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeLlamaCppPython()
    async with Fleet({"a": FakeNode(engine)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                await trio.sleep(10.0)  # five load intervals: nothing is read of it
                [node] = proxy.status()["nodes"]
    assert node["engine"] == {
        "kind": "llama-cpp-python",
        "found_by": 'GET /v1/models: owned_by "me" with permissions',
    }
    assert (node["capacity"], node["capacity_source"]) == (
        1,
        "auto (llama-cpp-python serves one request at a time)",
    )
    # The first check's three questions, and not one more: detection weighed
    # the check's /v1/models (each one on a check with no attempt in flight).
    first = [r.target for r in fleet["a"].received if r.at < 1.0]
    assert first == [b"/health", b"/v1/models", b"/api/tags"]
    assert {r.target for r in fleet["a"].received} == {b"/health", b"/v1/models", b"/api/tags"}


async def test_concurrent_streams_to_llama_cpp_python_run_one_at_a_time_and_all_complete(
    autojump_clock: trio.abc.Clock,
) -> None:
    """With its default settings a second request would end the running stream ([DONE])."""
    engine = FakeLlamaCppPython(tokens=5, token_delay=1.0)
    async with Fleet({"a": FakeNode(engine)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:  # no --capacity: auto is 1
                started = trio.current_time()
                responses = await together(proxy, [stream_of("tiny")] * 5)
                took = trio.current_time() - started
    assert [r.status for r in responses] == [200] * 5
    for response in responses:
        assert response.body.count(b'"content": "word') == 5, response.body
        assert response.body.endswith(b"data: [DONE]\n\n")
    assert (engine.interrupted, engine.served) == (0, ["tiny"] * 5)
    assert took == 25.0  # one after the other, each its five tokens


# -- detection stops at the first deciding answer -------------------------------------------


async def test_after_props_answers_detection_asks_nothing_else_and_props_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(FakeLlamaServer(slots=2))}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy:
                [node] = proxy.status()["nodes"]
    first = [r.target for r in fleet["a"].received if r.at < 1.0]
    # The check, then detection's one question, whose answer is the round's
    # /props reading too; then /slots.
    assert first == [b"/health", b"/v1/models", b"/api/tags", b"/props", b"/slots"]
    assert node["engine"] == {"kind": "llama-server", "found_by": "GET /props: total_slots"}
    assert node["capacity"] == 2


# -- capacity does not go stale -------------------------------------------------------------


def frozen_reads(engine: FakeLlamaServer, frozen: trio.Event) -> Any:
    """``engine``, but once ``frozen`` is set its /props and /slots never answer."""

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        if frozen.is_set() and received.target in (b"/props", b"/slots"):
            await trio.sleep_forever()
        await engine(io, received)

    return behave


async def test_capacity_holds_while_the_signals_are_stale_and_the_full_node_gets_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    frozen = trio.Event()
    a = FakeLlamaServer(slots=2, tokens=30, token_delay=1.0)
    b = FakeLlamaServer(slots=2, tokens=1, token_delay=1.0)
    async with Fleet({"a": FakeNode(frozen_reads(a, frozen)), "b": FakeNode(b)}) as fleet:
        with trio.fail_after(LIMIT):
            async with running(fleet) as proxy, trio.open_nursery() as nursery:
                assert capacities(proxy) == {"a": 2, "b": 2}
                for _ in range(2):  # fill a's two slots for 30 s
                    nursery.start_soon(partial(request, proxy, body=stream_of("tiny")))
                await trio.sleep(1.0)
                frozen.set()  # a's reads hang from now on: its signals go stale
                await trio.sleep(10.0)  # past three load intervals (6 s)
                [node_a, _] = proxy.status()["nodes"]
                response = await request(proxy, body=stream_of("tiny"))
    assert node_a["engine_signals"]["stale"] is True
    assert (node_a["capacity"], node_a["capacity_source"]) == (
        2,
        "auto (GET /props total_slots)",
    )
    assert node_a["in_flight"] == 2
    assert response is not None
    assert (response.status, node_of(response)) == (200, "b")
    assert a.deferred == 0  # nothing ever waited inside a


async def test_a_configured_llama_cpp_python_has_capacity_one_before_any_read(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeLlamaCppPython(tokens=2, token_delay=1.0)
    async with Fleet({"a": FakeNode(engine)}) as fleet:
        upstreams = [attrs.evolve(fleet.upstreams()[0], engine="llama-cpp-python")]
        # No checks, no reads: nothing is ever asked of it but the requests.
        config = Config(
            upstreams=upstreams, admin_listen=None, discovery_interval=0.0, load_interval=0.0
        )
        with trio.fail_after(LIMIT):
            async with Proxy(config, connector=fleet.connector) as proxy:
                [node] = proxy.status()["nodes"]
                responses = await together(proxy, [stream_of("tiny")] * 3)
    assert (node["capacity"], node["capacity_source"]) == (
        1,
        "auto (llama-cpp-python serves one request at a time)",
    )
    assert [r.status for r in responses] == [200] * 3
    assert (engine.interrupted, engine.served) == (0, ["tiny"] * 3)
    assert [r.target for r in fleet["a"].received] == [b"/v1/chat/completions"] * 3


async def test_a_reload_that_names_llama_cpp_python_gives_it_capacity_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(FakeLlamaCppPython())}) as fleet:
        config = Config(
            upstreams=fleet.upstreams(),
            admin_listen=None,
            discovery_interval=0.0,
            load_interval=0.0,
        )
        with trio.fail_after(LIMIT):
            async with Proxy(config, connector=fleet.connector) as proxy:
                before = capacities(proxy)
                named = [attrs.evolve(config.upstreams[0], engine="llama-cpp-python")]
                result = await proxy.reload(attrs.evolve(config, upstreams=named))
                after = capacities(proxy)
    assert result.ok
    assert (before, after) == ({"a": 0}, {"a": 1})  # auto: unknown, then its kind's
