"""Replicas over one real redis-server: two ``Proxy`` objects in one process.

The nodes are fake ones over in-memory streams, the shared state is real
(127.0.0.1 sockets, the real clock: no autojump). Every wait is for an
event (a node's, a board's, a proxy's event stream), bounded by
``trio.fail_after``. The real replica processes are in
``test_replica_processes.py``.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
from conftest import RedisServer
from test_redis_wire import SilentServer

from trio_failover.core.config import Config
from trio_failover.core.engines import Signals
from trio_failover.core.fleet_records import RemoteRecord
from trio_failover.core.inventory import CheckVerdict, Health
from trio_failover.core.liveness import CheckRecord
from trio_failover.core.node_change import NodeChange
from trio_failover.core.redis_url import RedisAddress
from trio_failover.core.state_layout import slots_key
from trio_failover.proxy.proxy import Proxy
from trio_failover.testing import (
    FakeNode,
    Fleet,
    HeldRequests,
    frozen,
    healthy,
    request,
    start_in_fleet,
)
from trio_failover.wire.redis import open_redis

LIMIT = 30.0
SLACK = 1.0  # how late a deadline may fire on a busy two-core machine
STREAM = b'{"model": "m", "stream": true}'


def replica_config(fleet: Fleet, address: RedisAddress, **settings: Any) -> Config:
    settings.setdefault("upstreams", fleet.upstreams())
    return Config(
        admin_listen=None,
        state=f"redis://{address.host}:{address.port}",
        state_timeout=0.25,
        **settings,
    )


@asynccontextmanager
async def replicas(
    fleet: Fleet, address: RedisAddress, count: int = 2, **settings: Any
) -> AsyncIterator[list[Proxy]]:
    proxies = [Proxy(replica_config(fleet, address, **settings), connector=fleet.connector)]
    proxies += [
        Proxy(replica_config(fleet, address, **settings), connector=fleet.connector)
        for _ in range(count - 1)
    ]
    for proxy in proxies:
        await start_in_fleet(proxy)
    yield proxies


@asynccontextmanager
async def replicas_at(
    address: RedisAddress, node: FakeNode, capacity: int, count: int = 1, **settings: Any
) -> AsyncIterator[list[Proxy]]:
    """``count`` replicas over ``address`` in front of one node, ``gpu-1``, of ``capacity``."""
    async with Fleet({"gpu-1": node}) as fleet:
        upstreams = [attrs.evolve(up, capacity=capacity) for up in fleet.upstreams()]
        async with replicas(fleet, address, count, upstreams=upstreams, **settings) as proxies:
            yield proxies


async def until_told(proxy: Proxy, condition: Callable[[NodeChange], bool]) -> None:
    """Return once ``proxy``'s board applied a change for which ``condition`` holds."""
    told = trio.Event()
    proxy.board.listen(
        lambda change: told.set() if isinstance(change, NodeChange) and condition(change) else None
    )
    await told.wait()


async def until_connected(proxy: Proxy, connected: bool) -> None:
    assert proxy.fleet is not None
    while proxy.fleet.state.connected != connected:
        await proxy.fleet.state.wait_changed()


async def until_replicas(proxy: Proxy, count: int) -> None:
    assert proxy.fleet is not None
    while proxy.fleet.state.replicas != count:
        await proxy.fleet.state.wait_changed()


async def test_a_node_frozen_for_one_replica_is_skipped_by_the_next(
    redis_server: RedisServer,
) -> None:
    fleet_nodes = {"gpu-1": FakeNode(frozen()), "gpu-2": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with Fleet(fleet_nodes) as fleet:
            settings = {"response_header_timeout": 0.5}
            async with replicas(fleet, redis_server.address, **settings) as (a, b):
                cooled = trio.Event()

                async def watch() -> None:
                    await until_told(b, lambda change: change.node == "gpu-1")
                    cooled.set()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    first = await request(a, body=STREAM)
                    assert first is not None
                    assert first.status == 200
                    assert len(fleet["gpu-1"].received) == 1
                    await cooled.wait()
                assert b.board.is_demoted("gpu-1", trio.current_time())
                second = await request(b, body=STREAM)
                assert second is not None
                assert second.status == 200
                # One attempt: straight to gpu-2, gpu-1 never asked again.
                assert len(fleet["gpu-1"].received) == 1
                assert len(fleet["gpu-2"].received) == 2
                assert len(b.recent[-1]["attempts"]) == 1


async def first_queued(*proxies: Proxy) -> Proxy:
    """The replica whose workload waits first in its queue (a ``queued`` event, a position)."""
    found: list[Proxy] = []
    async with trio.open_nursery() as nursery:

        async def watch(proxy: Proxy) -> None:
            with proxy.events.subscribe() as events:
                async for event in events:
                    if event.get("state") == "queued" and "position" in event:
                        found.append(proxy)
                        nursery.cancel_scope.cancel()

        for proxy in proxies:
            nursery.start_soon(watch, proxy)
    return found[0]


async def test_capacity_one_holds_across_two_replicas_and_the_waiter_runs_at_once(
    redis_server: RedisServer,
) -> None:
    gate = HeldRequests()
    with trio.fail_after(LIMIT):
        async with replicas_at(
            redis_server.address, FakeNode(gate.behaviour()), 1, 2, queue_timeout=20.0
        ) as (a, b):
            answers: list[int] = []

            async def send(proxy: Proxy) -> None:
                response = await request(proxy, body=STREAM)
                assert response is not None
                answers.append(response.status)

            async with trio.open_nursery() as nursery:
                waiting = nursery.start_soon  # both at once, one through each replica
                queued: list[Proxy] = []

                async def watch() -> None:
                    queued.append(await first_queued(a, b))

                async with trio.open_nursery() as watching:
                    watching.start_soon(watch)
                    await trio.lowlevel.checkpoint()
                    waiting(send, a)
                    waiting(send, b)
                await gate.wait_for(lambda: gate.now == 1)
                # One runs at the node, the other waits in its replica's queue.
                assert len(queued[0].queue) == 1
                assert len(gate.started) == 1
                gate.let_go()
                await gate.wait_for(lambda: len(gate.started) == 2)
                gate.let_go()
            assert answers == [200, 200]
            assert gate.most == 1
            # Woken by the announcement, not by a retry timer (5 s).
            assert gate.started[1] - gate.ended[0] < SLACK
            state = b.status()["state"]  # a learns of b at its next heartbeat
            assert state == {"backend": "redis", "connected": True, "replicas": 2}


async def test_an_attempt_at_one_replica_counts_in_the_others_status_and_least_loaded(
    redis_server: RedisServer,
) -> None:
    """In flight is the fleet's: b shows a's attempt at gpu-1 and sends its own to gpu-2."""
    gate = HeldRequests()
    fleet_nodes = {"gpu-1": FakeNode(gate.behaviour()), "gpu-2": FakeNode(healthy(b"two"))}
    with trio.fail_after(LIMIT):
        async with Fleet(fleet_nodes) as fleet:
            upstreams = [attrs.evolve(up, capacity=4) for up in fleet.upstreams()]
            settings = {"upstreams": upstreams, "balance": "least-loaded"}
            async with (
                replicas(fleet, redis_server.address, **settings) as (a, b),
                trio.open_nursery() as nursery,
            ):
                assert b.fleet is not None
                heard = b.fleet.fair.on_record
                told = trio.Event()

                def on_record(record: RemoteRecord) -> None:  # a's summaries, as b hears them
                    heard(record)
                    if b.queue.scheduler.ledger.fleet_in_flight("gpu-1"):
                        told.set()

                b.fleet.fair.on_record = on_record  # type: ignore[method-assign]
                nursery.start_soon(functools.partial(request, a, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)
                await told.wait()
                in_flight = {n["name"]: n["in_flight"] for n in b.status()["nodes"]}
                assert in_flight == {"gpu-1": 1, "gpu-2": 0}
                answer = await request(b, body=STREAM)
                assert answer is not None
                assert (answer.status, answer.header("x-failover-node")) == (200, "gpu-2")
                gate.let_go()
            assert len(fleet["gpu-1"].received) == 1


async def test_status_state_with_memory_is_the_backend_alone() -> None:
    async with Fleet({"gpu-1": FakeNode(healthy())}) as fleet:
        proxy = Proxy(Config(upstreams=fleet.upstreams(), admin_listen=None), connector=None)
        assert proxy.fleet is None
        assert proxy.status()["state"] == {"backend": "memory", "connected": True, "replicas": 1}


async def leases_at(address: RedisAddress, node: str) -> int:
    connection = await open_redis(address, deadline=trio.current_time() + 5)
    try:
        reply = await connection.execute(
            "ZCARD", slots_key("trio-failover:", node), deadline=trio.current_time() + 5
        )
    finally:
        await connection.aclose()
    assert isinstance(reply, int)
    return reply


async def test_redis_away_both_go_on_alone_and_rejoin_with_nothing_lost_or_doubled(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT + 20):
        async with Fleet(nodes) as fleet:
            upstreams = [attrs.evolve(up, capacity=2) for up in fleet.upstreams()]
            settings = {"upstreams": upstreams, "lease_ttl": 3.0}  # a heartbeat each second
            async with replicas(fleet, redis_server.address, **settings) as (a, b):
                for proxy in (a, b):
                    await until_replicas(proxy, 2)
                redis_server.stop()
                for proxy in (a, b):
                    await until_connected(proxy, False)
                    assert proxy.status()["state"]["connected"] is False
                    assert proxy.status()["state"]["replicas"] == 2
                away_until = trio.current_time() + 10
                served = 0
                while trio.current_time() < away_until:  # ten seconds without Redis
                    for proxy in (a, b):
                        response = await request(proxy, body=STREAM)
                        assert response is not None
                        assert response.status == 200
                        served += 1
                    with trio.move_on_at(away_until):
                        await trio.sleep(0.5)  # pacing the requests, not waiting for anything
                redis_server.start()
                for proxy in (a, b):
                    await until_connected(proxy, True)
                for proxy in (a, b):
                    await until_replicas(proxy, 2)
                    assert proxy.status()["state"] == {
                        "backend": "redis",
                        "connected": True,
                        "replicas": 2,
                    }
                for proxy in (a, b):
                    response = await request(proxy, body=STREAM)
                    assert response is not None
                    assert response.status == 200
                    assert proxy.fleet is not None
                    assert proxy.fleet.slots.held == {}
                assert len(nodes["gpu-1"].received) == served + 2  # each request once
                for proxy in (a, b):  # each kept its last lease as a spare: given back now
                    assert proxy.fleet is not None
                    await proxy.fleet.slots.spares.give_back_all()
                assert await leases_at(redis_server.address, "gpu-1") == 0


async def test_a_silent_redis_delays_no_request_past_the_state_timeout(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet:
            upstreams = [attrs.evolve(up, capacity=1) for up in fleet.upstreams()]
            async with replicas(fleet, redis_server.address, 1, upstreams=upstreams) as (a,):
                await until_connected(a, True)
                assert redis_server.process is not None
                os.kill(redis_server.process.pid, signal.SIGSTOP)  # accepts, answers nothing
                try:
                    started = trio.current_time()
                    response = await request(a, body=STREAM)
                    took = trio.current_time() - started
                finally:
                    os.kill(redis_server.process.pid, signal.SIGCONT)
                assert response is not None
                assert response.status == 200
                # The take waited one --state-timeout; the release another at most.
                assert took < 2 * 0.25 + SLACK


async def test_a_redis_silent_from_the_start_is_bounded_too() -> None:
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery, Fleet(nodes) as fleet:
            silent = SilentServer()
            await nursery.start(silent.serve)
            upstreams = [attrs.evolve(up, capacity=1) for up in fleet.upstreams()]
            address = silent.address
            started = trio.current_time()
            async with replicas(fleet, address, 1, upstreams=upstreams) as (a,):
                response = await request(a, body=STREAM)
            took = trio.current_time() - started
            assert response is not None
            assert response.status == 200
            assert a.status()["state"]["connected"] is False
            assert took < 3 * 0.25 + SLACK  # the join's connect, the take, the release
            nursery.cancel_scope.cancel()


async def test_checks_and_inventories_are_shared_a_joiner_loads_them_and_nothing_echoes(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(LIMIT):
        nodes = {"gpu-1": FakeNode(healthy()), "gpu-2": FakeNode(healthy())}
        async with Fleet(nodes) as fleet, replicas(fleet, redis_server.address) as (a, b):
            assert a.fleet is not None
            assert b.fleet is not None
            heard: list[RemoteRecord] = []
            told = trio.Event()
            a_apply = a.fleet.state.on_record

            def a_heard(record: RemoteRecord) -> None:
                heard.append(record)
                told.set()
                a_apply(record)

            a.fleet.state.on_record = a_heard
            b_changed = trio.Event()
            b.board.listen(
                lambda change: b_changed.set() if isinstance(change, NodeChange) else None
            )
            now = trio.current_time()
            verdict = CheckVerdict(Health.UNCHANGED, None, True, ("m1", "m2"), None, "ok")
            check = CheckRecord("health", True, 200, None, now)
            a.board.check_finished("gpu-1", verdict, now, record=check)
            a.board.demote("gpu-2", 60.0, "timeout", now)
            await b_changed.wait()  # the cooldown, told after the check: in order
            assert b.board.inventories.get("gpu-1") == ("m1", "m2")
            cooldown = b.board.cooldown("gpu-2", trio.current_time())
            assert cooldown is not None
            assert cooldown.reason == "timeout"
            last = b.board.nodes["gpu-1"].last_check
            assert last is not None
            assert (last.kind, last.ok, last.status) == ("health", True, 200)
            # B told nothing back: its marker is the first record A hears from it.
            assert await b.fleet.state.publish({"kind": "marker"}) is True
            await told.wait()
            assert [record.record["kind"] for record in heard] == ["marker"]

            # A replica joining later loads it all from the snapshot.
            async with replicas(fleet, redis_server.address, 1) as (c,):
                assert c.board.inventories.get("gpu-1") == ("m1", "m2")
                later = c.board.cooldown("gpu-2", trio.current_time())
                assert later is not None
                assert 55.0 < later.remaining(trio.current_time()) <= 60.0
                assert c.board.nodes["gpu-1"].last_check is not None


async def test_a_held_slot_is_renewed_past_its_ttl_while_its_attempt_runs(
    redis_server: RedisServer,
) -> None:
    gate, ttl = HeldRequests(), 1.2
    with trio.fail_after(LIMIT):
        async with replicas_at(
            redis_server.address,
            FakeNode(gate.behaviour()),
            1,
            2,
            lease_ttl=ttl,
            queue_timeout=20.0,
        ) as (a, b):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(request, a, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)
                nursery.start_soon(functools.partial(request, b, body=STREAM))
                # Three TTLs: unrenewed, the lease would have lapsed twice over.
                await trio.sleep(3 * ttl)
                assert len(gate.started) == 1
                gate.let_go()
                await gate.wait_for(lambda: len(gate.started) == 2)
                gate.let_go()
            assert gate.most == 1


async def test_a_slot_freed_by_another_replica_comes_off_this_ones_engine_reading(
    redis_server: RedisServer,
) -> None:
    # A's last reading of the engine counted B's attempt (busy 1 of 1); the
    # next one would come a load interval later. B's freed slot is announced
    # at once, and A's waiter runs then.
    gate = HeldRequests()
    with trio.fail_after(LIMIT):
        async with replicas_at(
            redis_server.address, FakeNode(gate.behaviour()), 1, 2, queue_timeout=20.0
        ) as (a, b):
            ledger = a.queue.scheduler.ledger
            signals = a.engines.signals
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(request, b, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)
                signals["gpu-1"] = Signals(busy=1)  # what A's engine reader saw now
                ledger.note_reading("gpu-1")
                with a.events.subscribe() as events:
                    nursery.start_soon(functools.partial(request, a, body=STREAM))
                    async for event in events:  # A's request waits: the reading says full
                        if event.get("state") == "queued" and "position" in event:
                            break
                gate.let_go()
                await gate.wait_for(lambda: len(gate.started) == 2)
                gate.let_go()
            assert gate.most == 1
            assert gate.started[1] - gate.ended[0] < SLACK
            # A's own release is not taken off the reading a second time.
            assert ledger.engine_busy("gpu-1") == 0


async def test_a_replicas_own_freed_slot_is_not_taken_off_the_engines_reading_again(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with replicas_at(redis_server.address, nodes["gpu-1"], 2) as (a,):
            assert a.fleet is not None
            ledger = a.queue.scheduler.ledger
            a.engines.signals["gpu-1"] = Signals(busy=1)  # another client's, not a replica's
            ledger.note_reading("gpu-1")
            heard = trio.Event()
            on_freed = a.fleet.state.on_freed

            def heard_freed(node: str, mine: bool) -> None:
                on_freed(node, mine)
                heard.set()

            a.fleet.state.on_freed = heard_freed
            response = await request(a, body=STREAM)
            assert response is not None
            assert response.status == 200
            # A's release, announced (A saw the node full: the other client's
            # work and its own), to A too, as its own.
            await heard.wait()
            # Its own slot came off its count once; the other client's work stays.
            assert ledger.engine_busy("gpu-1") == 1
