"""A rejoin takes the leases of the attempts that run: nothing lost or doubled.

An attempt that began while Redis was away holds no lease there, and a
restarted Redis kept none: without the rejoin's take the other replicas
would count that node's slots short until those attempts end. One replica
over a real redis-server, a node that holds its request until let go.
"""

from __future__ import annotations

import functools
from typing import Any

import trio
from conftest import RedisServer
from test_replicas import LIMIT, STREAM, leases_at, replicas_at, until_connected
from test_shared_state import Seen, joined, replica, wait_connected

from trio_failover.core.state_layout import replicas_key, slots_key
from trio_failover.testing import FakeNode, HeldRequests, request
from trio_failover.wire.redis import open_redis


async def test_an_attempt_begun_while_redis_was_away_is_counted_from_the_rejoin(
    redis_server: RedisServer,
) -> None:
    gate = HeldRequests()
    with trio.fail_after(LIMIT):
        async with replicas_at(redis_server.address, FakeNode(gate.behaviour()), 2) as (a,):
            assert a.fleet is not None
            state = a.fleet.state
            retaken, released = trio.Event(), trio.Event()
            take, release = state.take_slot, state.release_slot

            async def take_slot(node: str, lease: str, capacity: int) -> Any:
                answer = await take(node, lease, capacity)
                if capacity == 0:  # the rejoin's, with no limit
                    retaken.set()
                return answer

            async def release_slot(*args: Any, **kwargs: Any) -> bool:
                answer = await release(*args, **kwargs)
                released.set()
                return answer

            state.take_slot = take_slot  # type: ignore[method-assign]
            state.release_slot = release_slot  # type: ignore[method-assign]
            redis_server.stop()
            await until_connected(a, False)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(request, a, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)  # alone: no lease in Redis
                redis_server.start()  # empty: nothing was saved
                await until_connected(a, True)
                await retaken.wait()
                assert await leases_at(redis_server.address, "gpu-1") == 1
                gate.let_go()
            await released.wait()
            assert await leases_at(redis_server.address, "gpu-1") == 0


async def test_a_release_redis_could_not_hear_goes_out_at_the_next_join(
    redis_server: RedisServer,
) -> None:
    """The lease is in Redis, the replica's connections are cut, its release is owed.

    Cut by ``CLIENT KILL`` (Redis keeps its data): the release made while
    the replica is away cannot be written; at the rejoin it goes out
    before the next take on the new connection, which then finds the
    node's one slot free.
    """
    a = replica(redis_server.address, Seen(), "a", heartbeat_interval=0.2)
    with trio.fail_after(LIMIT):
        async with (
            joined(a),
            await open_redis(redis_server.address, deadline=trio.current_time() + 5) as admin,
        ):
            lease = a.new_lease_id()
            taken = await a.take_slot("gpu-1", lease, 1)
            assert taken is not None
            assert taken.taken
            await admin.execute("CLIENT", "KILL", "SKIPME", "yes", deadline=trio.current_time() + 5)
            await wait_connected(a, False)
            assert not await a.release_slot("gpu-1", lease, capacity=1, seen_full=True)
            assert await leases_at(redis_server.address, "gpu-1") == 1  # not heard
            await wait_connected(a, True)
            again = await a.take_slot("gpu-1", a.new_lease_id(), 1)
            assert again is not None
            assert again.taken


async def test_a_replica_whose_beat_lapsed_takes_its_running_attempts_leases_again(
    redis_server: RedisServer,
) -> None:
    """Another replica judged it dead (its beat and its lease gone from Redis), yet it runs.

    Its next beat finds its own gone: it takes the lease of the attempt it
    runs again, so the others count that attempt again.
    """
    gate = HeldRequests()
    with trio.fail_after(LIMIT):
        async with (
            replicas_at(redis_server.address, FakeNode(gate.behaviour()), 2) as (a,),
            await open_redis(redis_server.address, deadline=trio.current_time() + 5) as redis,
        ):
            assert a.fleet is not None
            state = a.fleet.state
            retaken = trio.Event()
            take = state.take_slot

            async def take_slot(node: str, lease: str, capacity: int) -> Any:
                answer = await take(node, lease, capacity)
                if capacity == 0:  # the retake, with no limit
                    retaken.set()
                return answer

            state.take_slot = take_slot  # type: ignore[method-assign]
            await until_connected(a, True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(request, a, body=STREAM))
                await gate.wait_for(lambda: gate.now == 1)
                assert await leases_at(redis_server.address, "gpu-1") == 1
                # What another replica's reap does: its beat and its lease gone.
                deadline = trio.current_time() + 5
                await redis.execute(
                    "ZREM", replicas_key("trio-failover:"), state.replica_id, deadline=deadline
                )
                await redis.execute("DEL", slots_key("trio-failover:", "gpu-1"), deadline=deadline)
                await retaken.wait()
                assert state.lapses == 1
                assert await leases_at(redis_server.address, "gpu-1") == 1
                gate.let_go()
