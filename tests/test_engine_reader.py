"""The engine reader under MockClock, over the in-memory connector, with the fake engines.

Exact virtual times: a configured engine is read at once and then every
``--load-interval``; an ``auto`` one is detected at its first good check and
read with each check; a read that hangs ends at its 2 s; ``openai`` gets one
signal and nothing is read of it.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio
import trio.testing

from trio_failover import Config
from trio_failover.core.engine_state import EngineRead
from trio_failover.core.engines import UNKNOWN, Answer, EngineKind
from trio_failover.proxy import Proxy
from trio_failover.proxy.nodes.engine_reader import EngineReader
from trio_failover.testing import (
    FakeLlamaCppPython,
    FakeLlamaServer,
    FakeNode,
    FakeOllama,
    FakeVllm,
    Fleet,
    frozen,
    healthy,
)

LIMIT = 600.0


def config_of(fleet: Fleet, engines: dict[str, str] | None = None, **settings: Any) -> Config:
    upstreams = [
        attrs.evolve(node, engine=(engines or {}).get(node.name, "auto"))
        for node in fleet.upstreams()
    ]
    return Config(upstreams=upstreams, admin_listen=None, **settings)


class Signals:
    """The callback: every signal, with its node, in order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, EngineRead]] = []

    def __call__(self, read: EngineRead) -> None:
        self.got.append((read.node, read))

    def of(self, node: str) -> list[EngineRead]:
        return [read for name, read in self.got if name == node]


async def after_one_good_check(fleet: Fleet, listing: Answer | None = None) -> Signals:
    """The signals of node ``a`` (auto) in the 10 s after one good check with ``listing``."""
    config = config_of(fleet, discovery_interval=30.0)
    got = Signals()
    reader = EngineReader(config, fleet.connector, got)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)
            reader.checked("a", good=True, listing=listing)
            await trio.sleep(10.0)
            nursery.cancel_scope.cancel()
    return got


def reads(node: FakeNode, path: bytes) -> list[float]:
    return [r.at for r in node.received if r.target == path]


async def test_a_configured_llama_server_is_read_at_once_then_every_interval(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeLlamaServer(slots=2)
    engine.set_other_clients(1)
    async with Fleet({"a": FakeNode(engine)}) as fleet:
        config = config_of(fleet, {"a": "llama-server"}, discovery_interval=0.0)
        got = Signals()
        reader = EngineReader(config, fleet.connector, got)
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.run)
                await trio.sleep(5.0)
                nursery.cancel_scope.cancel()
    assert reads(fleet["a"], b"/slots") == [0.0, 2.0, 4.0]
    assert reads(fleet["a"], b"/props") == [0.0, 2.0, 4.0]
    first = got.of("a")[0]
    assert (first.engine.kind, first.engine.found_by) == (EngineKind.LLAMA_SERVER, "configured")
    assert (first.signals.busy, first.signals.total_slots, first.signals.last_error) == (1, 2, "")
    assert [signal.at for signal in got.of("a")] == [0.0, 2.0, 4.0]
    assert fleet["a"].received[0].header("x-request-id") is None  # no attempt, a GET of its own


async def test_an_auto_node_is_detected_at_its_first_good_check_and_read_with_each(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(FakeOllama(loaded=["fake-model:latest"]))}) as fleet:
        config = config_of(fleet, discovery_interval=30.0, load_interval=0.0)
        proxy = Proxy(config, connector=fleet.connector)
        got = Signals()
        proxy.engine_reader.on_signal = got
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(proxy.engine_reader.run)
                await nursery.start(proxy.discovery.run)
                await trio.sleep(40.0)
                nursery.cancel_scope.cancel()
    # Nothing before the first check (at 0: one node); then with each check only.
    detected = [r.target for r in fleet["a"].received if r.target.startswith(b"/api/version")]
    assert len(detected) == 1
    checked = [r.at for r in fleet["a"].received if r.target == b"/health"]
    assert reads(fleet["a"], b"/api/ps") == checked == [0.0, checked[1]]  # 2nd: jittered
    signal = got.of("a")[0]
    assert (signal.engine.kind, signal.engine.found_by) == (
        EngineKind.OLLAMA,
        "GET /api/version: version",
    )
    assert signal.signals.loaded == frozenset({"fake-model:latest"})


async def test_a_hanging_read_ends_at_two_seconds_with_last_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen())}) as fleet:
        config = config_of(fleet, {"a": "vllm"}, discovery_interval=0.0, load_interval=5.0)
        got = Signals()
        reader = EngineReader(config, fleet.connector, got)
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.run)
                await trio.sleep(6.0)
                nursery.cancel_scope.cancel()
    assert [signal.at for signal in got.of("a")] == [2.0]
    signals = got.of("a")[0].signals
    assert signals.busy is None
    assert signals.last_error == "GET /metrics: no whole answer in 2.0s"
    assert reads(fleet["a"], b"/metrics") == [0.0, 5.0]  # the next read on its schedule


async def test_a_node_that_is_no_engine_is_openai_and_read_no_more(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy(b"{}", status=404))}) as fleet:
        got = await after_one_good_check(fleet)
    assert [(s.engine.kind, s.engine.found_by) for s in got.of("a")] == [
        (EngineKind.OPENAI, "no engine answer")
    ]
    # Detection's five questions, once each, in order; never /v1/models (the check's).
    assert [r.target for r in fleet["a"].received] == [
        b"/props",
        b"/api/version",
        b"/metrics",
        b"/api/v0/models",
        b"/openapi.json",
    ]


async def test_llama_cpp_python_is_detected_by_its_openapi_title_when_the_check_had_no_list(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(FakeLlamaCppPython())}) as fleet:
        got = await after_one_good_check(fleet)  # an attempt was in flight: no listing
    [signal] = got.of("a")
    assert (signal.engine.kind, signal.engine.found_by) == (
        EngineKind.LLAMA_CPP_PYTHON,
        'GET /openapi.json: title "llama.cpp Python API"',
    )
    assert signal.signals == UNKNOWN  # nothing read of it: its capacity is its kind's
    targets = [r.target for r in fleet["a"].received]
    assert targets[-1] == b"/openapi.json"
    assert b"/v1/models" not in targets  # the one read that would end a running stream


async def test_the_checks_model_list_decides_and_nothing_is_asked(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeLlamaCppPython()
    async with Fleet({"a": FakeNode(engine)}) as fleet:
        listing = Answer(200, "application/json", json.dumps(engine.model_list()).encode())
        got = await after_one_good_check(fleet, listing)
    assert [s.engine.kind for s in got.of("a")] == [EngineKind.LLAMA_CPP_PYTHON]
    assert fleet["a"].received == []


async def test_an_auto_node_is_detected_only_at_a_good_check_with_an_answer(
    autojump_clock: trio.abc.Clock,
) -> None:
    vllm = FakeNode(FakeVllm(slots=4))
    async with Fleet({"a": FakeNode(refuse=True)}) as fleet:
        config = config_of(fleet, discovery_interval=30.0)
        got = Signals()
        reader = EngineReader(config, fleet.connector, got)
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.run)
                reader.checked("a", good=False)  # down: nothing is asked
                await trio.sleep(3.0)
                reader.checked("a", good=True)  # a good check, but the reads fail
                await trio.sleep(1.0)
                assert got.got == []  # not taken for openai: detection waits for an answer
                assert len(fleet["a"].received) == 0
                fleet.nodes["a"] = vllm  # the engine answers from now on
                await trio.sleep(2.0)  # the next interval
                nursery.cancel_scope.cancel()
    kinds = [(s.engine.kind, s.at) for s in got.of("a")]
    assert kinds == [(EngineKind.VLLM, 5.0)]
    assert got.of("a")[0].signals.busy == 0


async def test_with_discovery_off_an_auto_node_is_never_read(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(FakeLlamaServer())}) as fleet:
        config = config_of(fleet, discovery_interval=0.0)
        reader = EngineReader(config, fleet.connector, Signals())
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.run)
                await trio.sleep(10.0)
                nursery.cancel_scope.cancel()
    assert fleet["a"].received == []


async def test_nothing_is_read_with_no_interval_and_no_checks(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(FakeLlamaServer())}) as fleet:
        config = config_of(fleet, discovery_interval=0.0, load_interval=0.0)
        reader = EngineReader(config, fleet.connector, Signals())
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.run)
                await trio.sleep(10.0)
                nursery.cancel_scope.cancel()
    assert fleet["a"].received == []


async def test_a_reload_starts_added_readers_stops_removed_ones_and_takes_the_interval(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({name: FakeNode(FakeLlamaServer()) for name in "abc"}) as fleet:
        everyone = config_of(fleet, dict.fromkeys("abc", "llama-server"), discovery_interval=0.0)
        first = attrs.evolve(everyone, upstreams=everyone.upstreams[:2])  # a and b
        got = Signals()
        reader = EngineReader(first, fleet.connector, got)
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.run)
                await trio.sleep(3.0)  # a and b read at 0 and 2
                # b and c now, every 5 s: a stops, c starts at once, b begins again
                reader.reconcile(
                    attrs.evolve(everyone, upstreams=everyone.upstreams[1:], load_interval=5.0)
                )
                reader.checked("a", good=True)  # a check of a removed node: nothing
                await trio.sleep(8.0)
                nursery.cancel_scope.cancel()
    assert reads(fleet["a"], b"/slots") == [0.0, 2.0]
    assert reads(fleet["b"], b"/slots") == [0.0, 2.0, 3.0, 8.0]
    assert reads(fleet["c"], b"/slots") == [3.0, 8.0]


async def test_a_reload_that_turns_reads_on_starts_them(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(FakeLlamaServer())}) as fleet:
        off = config_of(fleet, {"a": "llama-server"}, discovery_interval=0.0, load_interval=0.0)
        reader = EngineReader(off, fleet.connector, Signals())
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.run)
                await trio.sleep(3.0)
                reader.reconcile(attrs.evolve(off, load_interval=2.0))
                await trio.sleep(3.0)
                nursery.cancel_scope.cancel()
    assert reads(fleet["a"], b"/slots") == [3.0, 5.0]
