"""Engine signals shared between replicas over one real redis-server.

Replica A reads the fake engines (discovery and the engine reader run);
replica B runs neither, so whatever it knows of an engine came from A
through Redis. The nodes are fake llama-servers over in-memory streams, the
shared state is real (127.0.0.1 sockets, the real clock): every wait is for
an event, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import pytest
import trio
from conftest import RedisServer
from test_replicas import LIMIT, SLACK, replica_config, replicas

from trio_failover.core import fleet_records
from trio_failover.core.engine_book import EngineChange, EngineSettings
from trio_failover.core.engine_state import EngineRead
from trio_failover.core.engines import UNKNOWN, Detection, EngineKind, Signals
from trio_failover.core.fleet_records import RemoteRecord
from trio_failover.core.redis_url import RedisAddress
from trio_failover.proxy.fleet.fleet import FleetBoard
from trio_failover.proxy.fleet.shared_state import SharedState
from trio_failover.proxy.nodes.board import NodeBoard
from trio_failover.proxy.proxy import Proxy
from trio_failover.testing import FakeLlamaServer, FakeNode, Fleet, healthy, request, start_in_fleet

INTERVAL = 0.2  # --load-interval: a reading is unknown once older than 0.6 s
LLAMA = Detection(EngineKind.LLAMA_SERVER, "configured")


def stream_of(model: str) -> bytes:
    return json.dumps({"model": model, "stream": True, "messages": []}).encode()


def replica(fleet: Fleet, address: RedisAddress, **settings: Any) -> Proxy:
    config = replica_config(fleet, address, load_interval=INTERVAL, **settings)
    return Proxy(config, connector=fleet.connector)


def engine_told(proxy: Proxy, condition: Callable[[EngineChange], bool]) -> trio.Event:
    """An event set once ``proxy``'s board tells an engine change for which ``condition`` holds."""
    told = trio.Event()
    proxy.board.listen(
        lambda change: (
            told.set() if isinstance(change, EngineChange) and condition(change) else None
        )
    )
    return told


def engine_record(signals: Signals, age: float) -> dict[str, Any]:
    """The record of a read of node ``a`` that was ``age`` seconds old when written."""
    return fleet_records.encode(EngineRead("a", LLAMA, signals, at=-age), now=0.0)


def busy_at(node: str, busy: int) -> Callable[[EngineChange], bool]:
    return lambda change: change.node == node and change.signals.busy == busy


def node_status(proxy: Proxy, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(node for node in proxy.status()["nodes"] if node["name"] == name)
    return found


def busy_llama_servers() -> dict[str, FakeLlamaServer]:
    engines = {name: FakeLlamaServer(slots=2) for name in ("a", "b")}
    engines["a"].set_other_clients(2)  # both of a's slots taken by work past the proxies
    return engines


async def test_a_replica_that_reads_no_engine_routes_by_the_readings_of_another(
    redis_server: RedisServer,
) -> None:
    engines = busy_llama_servers()
    with trio.fail_after(LIMIT):
        async with Fleet({name: FakeNode(engine) for name, engine in engines.items()}) as fleet:
            b = await start_in_fleet(replica(fleet, redis_server.address))  # reads nothing
            a_full = engine_told(b, busy_at("a", 2))
            a = replica(fleet, redis_server.address)
            assert a.fleet is not None
            assert b.fleet is not None
            heard: list[RemoteRecord] = []
            marker = trio.Event()
            a_apply = a.fleet.state.on_record

            def a_heard(record: RemoteRecord) -> None:
                heard.append(record)
                if record.record["kind"] == "marker":
                    marker.set()
                a_apply(record)

            a.fleet.state.on_record = a_heard
            await start_in_fleet(a, discovery=True)  # checks, detects and reads the engines
            await a_full.wait()
            # B learnt a's capacity (auto: /props' total_slots) and its load from A.
            assert node_status(b, "a")["capacity"] == 2
            signals = node_status(b, "a")["engine_signals"]
            assert (signals["busy"], signals["total_slots"], signals["stale"]) == (2, 2, False)
            response = await request(b, body=stream_of("tiny"))
            assert response is not None
            assert response.status == 200
            # Full by its engine's count: by B's own count (none) a was free and first.
            assert response.header("x-failover-node") == "b"
            assert not [r for r in fleet["a"].received if r.method == b"POST"]

            # B told nothing back: its marker is the first record A hears from it.
            assert await b.fleet.state.publish({"kind": "marker"}) is True
            await marker.wait()
            assert [record.record["kind"] for record in heard] == ["marker"]

            # A replica joining later has the reading at once, from the snapshot.
            c = await start_in_fleet(replica(fleet, redis_server.address))
            assert c.engines.signals["a"].busy == 2


async def test_a_remote_reading_goes_stale_after_three_intervals_and_then_limits_nothing(
    redis_server: RedisServer,
) -> None:
    engines = busy_llama_servers()
    with trio.fail_after(LIMIT):
        async with Fleet({name: FakeNode(engine) for name, engine in engines.items()}) as fleet:
            b = await start_in_fleet(replica(fleet, redis_server.address))  # reads nothing
            a_full = engine_told(b, busy_at("a", 2))
            async with replica(fleet, redis_server.address):  # A: discovery and reads run
                await a_full.wait()
            stopped = trio.current_time()  # A reads no more
            unknown = engine_told(b, lambda change: change.node == "a" and change.changed)
            with trio.fail_after(3 * INTERVAL + SLACK):
                await unknown.wait()
            assert trio.current_time() - stopped > 2 * INTERVAL  # not at once: when it aged
            assert "a" not in b.engines.signals
            assert node_status(b, "a")["engine_signals"]["stale"] is True
            # The load is unknown; the capacity is the last total_slots it said.
            assert node_status(b, "a")["capacity"] == 2
            engines["a"].set_other_clients(0)
            response = await request(b, body=stream_of("tiny"))
            assert response is not None
            assert response.status == 200
            assert response.header("x-failover-node") == "a"  # first again


async def test_a_reading_that_arrives_older_than_three_intervals_is_unknown_at_once(
    redis_server: RedisServer,
) -> None:
    nodes = {"a": FakeNode(healthy()), "b": FakeNode(healthy())}
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet:
            settings = {"load_interval": INTERVAL}
            async with replicas(fleet, redis_server.address, **settings) as (a, b):
                assert a.fleet is not None
                full = Signals(busy=2, total_slots=2)
                told = engine_told(b, lambda change: change.node == "a")
                old = engine_record(full, 1.0)
                assert await a.fleet.state.publish(old, node="a") is True
                await told.wait()
                assert "a" not in b.engines.signals  # read a second ago: stale on arrival
                signals = node_status(b, "a")["engine_signals"]
                assert signals["stale"] is True
                assert signals["age_s"] >= 1.0
                assert node_status(b, "a")["capacity"] == 2  # the capacity never goes stale

                fresh = engine_told(b, busy_at("a", 2))
                new = engine_record(full, 0.0)
                assert await a.fleet.state.publish(new, node="a") is True
                await fresh.wait()
                assert b.engines.signals["a"] == full
                assert node_status(b, "a")["capacity"] == 2
                assert b.engines.signals.get("b", UNKNOWN) == UNKNOWN

                # One taken before the reading B has (late, from a slow replica) is no news.
                late = engine_told(b, lambda change: change.node == "a")
                idle = Signals(busy=0, total_slots=2)
                older = engine_record(idle, 0.4)
                assert await a.fleet.state.publish(older, node="a") is True
                await late.wait()
                assert b.engines.signals["a"] == full


async def test_a_late_older_reading_does_not_shorten_the_watch_of_the_newer_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``age_engines`` judges a remote reading when the newest one heard is stale, not before."""
    board = NodeBoard(["a"])
    board.configure_engines(EngineSettings(engines={"a": LLAMA}, max_age=3 * INTERVAL))
    link = FleetBoard(board, cast(SharedState, None))  # nothing published here
    told: list[tuple[float, EngineChange]] = []
    board.listen(
        lambda change: (
            told.append((trio.current_time(), change)) if isinstance(change, EngineChange) else None
        )
    )

    def heard(busy: int, age: float) -> None:
        record = engine_record(Signals(busy=busy, total_slots=2), age)
        link.on_record(RemoteRecord("replica-a", "a", record))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.age_engines)
        start = trio.current_time()
        heard(2, 0.0)
        await trio.sleep(0.1)
        heard(1, 0.5)  # taken 0.4 s before the one heard first: no news
        await trio.sleep(0.4)  # 0.5 s after the newer reading: fresh still
        assert board.engines.signals["a"].busy == 2
        await trio.sleep(0.2)
        assert "a" not in board.engines.signals  # past 0.6 s: unknown, without a read
        nursery.cancel_scope.cancel()
    ended = [at - start for at, change in told if change.changed and change.signals == UNKNOWN]
    assert ended == [pytest.approx(3 * INTERVAL + 0.001)]
