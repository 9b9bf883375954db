"""Spare slot leases (proxy/fleet/spare_leases.py): an ended attempt's lease kept for the next.

The keeping rule is table-tested under a MockClock; the rest runs two
replicas (``Proxy`` objects) over one real redis-server, as
``test_replicas.py`` does: real sockets, the real clock, every wait for
an event and bounded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from conftest import RedisServer
from test_replicas import LIMIT, SLACK, STREAM, replicas, replicas_at, until_connected

from trio_failover.core.redis_url import RedisAddress
from trio_failover.core.state_layout import slots_key
from trio_failover.proxy.fleet.spare_leases import RECYCLE_MOST, SpareLease, SpareLeases
from trio_failover.proxy.proxy import Proxy
from trio_failover.testing import FakeNode, Fleet, HeldRequests, healthy, request
from trio_failover.wire.redis import open_redis


@attrs.define
class StubState:
    lease_ttl: float = 30.0
    released: list[str] = attrs.Factory(list)
    changed: trio.Event = attrs.Factory(trio.Event)

    async def release_slot(self, node: str, lease: str, **_: object) -> bool:
        self.released.append(lease)
        self.changed.set()
        return True


@pytest.mark.parametrize(
    ("in_redis", "capacity", "age", "crowded", "wanted", "kept"),
    [
        (True, 3, 0.0, False, None, True),
        (True, 1, 0.0, False, None, True),  # capacity 1 too: nobody asked for it since
        (True, 8, 0.0, True, None, False),  # the engine's count fills the node with others' work
        (True, 1, 0.0, False, 0.5, False),  # wanted while it ran: released, announced
        (True, 1, 0.0, False, 0.0, False),  # wanted in the instant it was taken: the same
        (True, 1, 0.0, False, -0.5, True),  # wanted before its take: that waiter's news is old
        (True, 8, 9.9, False, None, True),
        (True, 8, RECYCLE_MOST, False, None, False),  # judged too long ago: taken afresh
        (False, 8, 0.0, False, None, False),  # taken alone while Redis was away
    ],
)
def test_a_lease_is_kept_only_while_nobody_else_wants_its_slot(
    in_redis: bool,
    capacity: int,
    age: float,
    crowded: bool,
    wanted: float | None,
    kept: bool,
) -> None:
    async def main() -> None:
        spares = SpareLeases(StubState())  # type: ignore[arg-type]
        if wanted is not None and wanted < 0:  # told before the take
            spares.wanted("gpu-1")
            await trio.sleep(-wanted)
        spare = SpareLease("l1", in_redis, trio.current_time())
        if wanted is not None and wanted >= 0:  # told while the attempt ran
            await trio.sleep(wanted)
            spares.wanted("gpu-1")
        await trio.sleep(age)
        assert spares.keep("gpu-1", spare, capacity, crowded=crowded) is kept
        assert await spares.use("gpu-1", capacity) == (spare if kept else None)
        assert await spares.use("gpu-1", capacity) is None  # used once

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_one_spare_per_node_and_a_short_ttl_shortens_the_window() -> None:
    async def main() -> None:
        spares = SpareLeases(StubState(lease_ttl=0.6))  # type: ignore[arg-type]
        now = trio.current_time()
        assert spares.keep("gpu-1", SpareLease("a", True, now), 8, crowded=False)
        assert not spares.keep("gpu-1", SpareLease("b", True, now), 8, crowded=False)
        await trio.sleep(0.15)  # a third of the TTL less a hold: a kept lease is not renewed
        assert not spares.keep("gpu-2", SpareLease("c", True, now), 8, crowded=False)
        tiny = SpareLeases(StubState(lease_ttl=0.15))  # type: ignore[arg-type]
        assert not tiny.keep("gpu-1", SpareLease("d", True, trio.current_time()), 8, crowded=False)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_spare_kept_under_another_capacity_is_given_back_not_used() -> None:
    async def main() -> None:
        state = StubState()
        spares = SpareLeases(state)  # type: ignore[arg-type]
        assert spares.keep("gpu-1", SpareLease("a", True, trio.current_time()), 8, crowded=False)
        assert await spares.use("gpu-1", 2) is None  # a reload lowered the capacity
        assert state.released == ["a"]
        assert spares.keep("gpu-1", SpareLease("b", True, trio.current_time()), 8, crowded=False)
        await spares.give_back_all()  # Redis lost or joined again
        assert state.released == ["a", "b"]
        assert await spares.use("gpu-1", 8) is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_unused_spares_go_back_within_two_holds_and_all_at_the_end() -> None:
    async def main() -> None:
        state = StubState()
        spares = SpareLeases(state)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spares.give_back_unused)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            assert spares.keep("gpu-1", SpareLease("a", True, start), 8, crowded=False)
            await state.changed.wait()
            assert spares.hold <= trio.current_time() - start <= 2 * spares.hold + 0.01
            assert spares.keep(
                "gpu-1", SpareLease("b", True, trio.current_time()), 8, crowded=False
            )
            nursery.cancel_scope.cancel()
        assert state.released == ["a", "b"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def counted(calls: list[str], call: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])  # the lease id
        return await call(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("capacity", [1, 3])
async def test_the_next_attempt_at_a_node_nobody_else_wants_asks_redis_nothing(
    redis_server: RedisServer, capacity: int
) -> None:
    """Three requests one after another take one lease; it goes back when the proxy stops.

    The hold is made long (and the TTL with it), so that no gap between the
    requests, on however slow a machine, outlasts it; the give-back after
    an unused hold is timed under the MockClock above.
    """
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    takes: list[str] = []
    releases: list[str] = []
    key = slots_key("trio-failover:", "gpu-1")
    with trio.fail_after(LIMIT):
        async with await open_redis(
            redis_server.address, deadline=trio.current_time() + 5
        ) as redis:
            async with replicas_at(
                redis_server.address, nodes["gpu-1"], capacity, lease_ttl=600.0
            ) as (a,):
                assert a.fleet is not None
                a.fleet.slots.spares.hold = 60.0
                state = a.fleet.state
                state.take_slot = counted(takes, state.take_slot)  # type: ignore[method-assign]
                state.release_slot = counted(releases, state.release_slot)  # type: ignore[method-assign]
                for _ in range(3):
                    response = await request(a, body=STREAM)
                    assert response is not None
                    assert response.status == 200
                    assert releases == []  # kept, not released
                assert len(takes) == 1  # one lease served all three
                deadline = trio.current_time() + 5
                assert await redis.execute("ZCARD", key, deadline=deadline) == 1
            assert releases == takes  # the proxy stopped: its spare given back
            deadline = trio.current_time() + 5
            assert await redis.execute("ZCARD", key, deadline=deadline) == 0


@contextlib.asynccontextmanager
async def two_holding(
    address: RedisAddress, gate: HeldRequests, capacity: int
) -> AsyncIterator[list[Proxy]]:
    """Replicas A and B in front of ``gate``'s node; A's spares wait 60 s for their next use.

    A hold of 60 s needs a TTL over three of them (a kept lease is not
    renewed), and a queue timeout past the tests' waits.
    """
    async with replicas_at(
        address, FakeNode(gate.behaviour()), capacity, 2, queue_timeout=20.0, lease_ttl=600.0
    ) as proxies:
        assert proxies[0].fleet is not None
        proxies[0].fleet.slots.spares.hold = 60.0
        yield proxies


@pytest.mark.parametrize("capacity", [1, 3])
async def test_a_take_refused_elsewhere_gets_the_spare_given_back_at_once(
    redis_server: RedisServer, capacity: int
) -> None:
    """A keeps a spare at a node; B fills the rest, and B's next waits.

    The refusal is told on the wanted channel: A gives its spare back at
    once (its hold is made long here), and B's waiter runs; the node never
    sees more than its capacity.
    """
    gate = HeldRequests()
    with trio.fail_after(LIMIT):
        async with two_holding(redis_server.address, gate, capacity) as (a, b):
            kept = on_kept(a)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(request, a, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)
                gate.let_go()
                await gate.wait_for(lambda: gate.now == 0)
                await kept.wait()
                for count in range(1, capacity):
                    nursery.start_soon(functools.partial(request, b, body=STREAM))
                    await gate.wait_for(lambda count=count: gate.now == count)  # type: ignore[misc]
                refused = trio.current_time()
                nursery.start_soon(functools.partial(request, b, body=STREAM))
                await gate.wait_for(lambda: gate.now == capacity)
                assert trio.current_time() - refused < SLACK  # not the 60 s hold
                for _ in range(capacity):
                    gate.let_go()
                    await gate.wait_for(lambda: gate.now < capacity)
                await gate.wait_for(lambda: gate.now == 0)
            assert gate.most == capacity


def on_kept(proxy: Proxy) -> trio.Event:
    """Set once the proxy keeps an ended attempt's lease (that runs after the reply)."""
    assert proxy.fleet is not None
    spares = proxy.fleet.slots.spares
    keep, kept = spares.keep, trio.Event()

    def keeping(*args: Any, **kwargs: Any) -> bool:
        if keep(*args, **kwargs):
            kept.set()
            return True
        return False

    spares.keep = keeping  # type: ignore[method-assign]
    return kept


async def test_spares_never_let_the_fleet_pass_a_nodes_capacity(
    redis_server: RedisServer,
) -> None:
    """Two replicas, capacity 3, many short requests through both at once."""
    now = most = 0

    async def brief(io: Any, received: Any) -> None:
        nonlocal now, most
        now += 1
        most = max(most, now)
        try:
            for _ in range(20):
                await trio.lowlevel.checkpoint()
            await healthy(b"hi")(io, received)
        finally:
            now -= 1

    with trio.fail_after(LIMIT):
        async with Fleet({"gpu-1": FakeNode(brief)}) as fleet:
            upstreams = [attrs.evolve(up, capacity=3) for up in fleet.upstreams()]
            settings: dict[str, Any] = {"upstreams": upstreams, "queue_timeout": 20.0}
            async with replicas(fleet, redis_server.address, **settings) as (a, b):
                answers: list[int] = []

                async def client(proxy: Proxy) -> None:
                    for _ in range(6):
                        response = await request(proxy, body=STREAM)
                        assert response is not None
                        answers.append(response.status)

                async with trio.open_nursery() as nursery:
                    for index in range(6):
                        nursery.start_soon(client, a if index % 2 else b)
    assert answers == [200] * 36
    assert 1 <= most <= 3


async def test_a_spare_is_given_back_when_redis_goes_and_not_used_while_away(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with replicas_at(redis_server.address, nodes["gpu-1"], 3, lease_ttl=600.0) as (a,):
            assert a.fleet is not None
            spares = a.fleet.slots.spares
            spares.hold = 60.0
            kept = on_kept(a)
            response = await request(a, body=STREAM)
            assert response is not None
            assert response.status == 200
            await kept.wait()
            redis_server.stop()
            await until_connected(a, False)
            await trio.testing.wait_all_tasks_blocked()
            assert await spares.use("gpu-1", 3) is None  # given back (or gone with Redis)
            # Away: this replica decides alone, and keeps nothing for later.
            response = await request(a, body=STREAM)
            assert response is not None
            assert response.status == 200
            assert await spares.use("gpu-1", 3) is None


@attrs.frozen
class Reading:
    """An engine's reading, as ``SlotLedger`` reads one (``EngineLoad``)."""

    busy: int | None
    waiting: int | None = 0


async def test_a_waiter_held_back_by_the_engines_count_asks_for_the_slot(
    redis_server: RedisServer,
) -> None:
    """Capacity 1: A runs an attempt that B's engine reading counts, and B's request waits.

    B's ledger sees the node full by that count, so B asks Redis nothing:
    its queued workload tells the wanted channel instead. A then keeps no
    spare (its hold is made long here) and the release is announced, so
    B's waiter runs at once, not at the engine's next reading.
    """
    gate = HeldRequests()
    with trio.fail_after(LIMIT):
        async with two_holding(redis_server.address, gate, 1) as (a, b):
            assert a.fleet is not None
            b.queue.scheduler.ledger.signals = {"gpu-1": Reading(busy=1)}  # A's attempt
            heard = on_wanted(a)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(request, a, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)
                assert b.queue.scheduler.ledger.full_by_others("gpu-1")
                nursery.start_soon(functools.partial(request, b, body=STREAM))
                await heard.wait()  # B's waiter asked, and A heard it
                gate.let_go()
                ended = trio.current_time()
                await gate.wait_for(lambda: len(gate.started) == 2)
                assert trio.current_time() - ended < SLACK  # not the 60 s hold
                gate.let_go()
            assert gate.most == 1
            assert await a.fleet.slots.spares.use("gpu-1", 1) is None  # nothing was kept


def on_wanted(proxy: Proxy) -> trio.Event:
    """Set once the proxy hears that a workload somewhere waits for a node."""
    assert proxy.fleet is not None
    slots = proxy.fleet.slots
    wanted, heard = slots.wanted, trio.Event()

    def hearing(node: str) -> None:
        wanted(node)
        heard.set()

    slots.wanted = hearing  # type: ignore[method-assign]
    return heard


async def test_a_replica_with_its_own_waiter_still_lets_a_refused_one_elsewhere_in(
    redis_server: RedisServer,
) -> None:
    """Capacity 1: A runs one attempt and queues a second; B's request is refused meanwhile.

    Were A to keep the lease for its own waiter, B's would wait for good
    (A keeps it busy; nothing is announced). Told on the wanted channel,
    A releases it at the attempt's end, announced: each request runs one
    after the other, none waits past the end of the one before.
    """
    gate = HeldRequests()
    with trio.fail_after(LIMIT):
        async with two_holding(redis_server.address, gate, 1) as (a, b):
            assert a.fleet is not None
            heard = on_wanted(a)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(request, a, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)
                nursery.start_soon(functools.partial(request, a, body=STREAM))  # A's waiter
                nursery.start_soon(functools.partial(request, b, body=STREAM))
                await heard.wait()  # B's take was refused, and A heard it
                for started in (2, 3):
                    gate.let_go()
                    ended = trio.current_time()
                    await gate.wait_for(lambda started=started: len(gate.started) == started)  # type: ignore[misc]
                    assert trio.current_time() - ended < SLACK
                gate.let_go()
            assert gate.most == 1
