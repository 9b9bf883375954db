"""The slot lease's Lua scripts against a real redis-server: capacity holds fleet-wide.

Real sockets and the real clock: a lease's expiry is Redis' own ``TIME``,
so the TTL tests wait for it (a fraction of a second, told by the refused
take's ``retry_after``, never guessed).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.lowlevel
import trio.testing
from conftest import RedisServer

from trio_failover.core import state_layout
from trio_failover.core.errors import StateError
from trio_failover.core.state_layout import LeaseTake, slots_key
from trio_failover.wire.redis import (
    Message,
    RedisConnection,
    Subscription,
    open_redis,
    open_subscription,
)
from trio_failover.wire.slot_lease import SharedRecords, SlotLeases

LIMIT = 10.0
TTL = 30.0


def soon() -> float:
    return trio.current_time() + 5.0


async def next_message(subscription: Subscription) -> Message:
    with trio.fail_after(5):
        return await subscription.__anext__()


async def release(
    leases: SlotLeases, node: str, lease: str, *, capacity: int = 1, seen_full: bool = False
) -> bool:
    """Post the release, then let a later call read its answer (as the proxy's next take does)."""
    answers: list[bool | StateError] = []
    assert await leases.release(
        node,
        lease,
        capacity=capacity,
        seen_full=seen_full,
        origin="replica-a",
        deadline=soon(),
        on_answer=answers.append,
    )
    assert answers == []  # nobody waited for it
    await leases.connection.execute("PING", deadline=soon())
    (answer,) = answers
    assert isinstance(answer, bool)
    return answer


@contextlib.asynccontextmanager
async def watching_freed(server: RedisServer) -> AsyncIterator[tuple[Subscription, SlotLeases]]:
    """A subscription to the freed announcements, and the lease verbs on another connection."""
    async with (
        await open_subscription(server.address, ["trio-failover:freed"], deadline=soon()) as freed,
        await open_redis(server.address, deadline=soon()) as redis,
    ):
        yield freed, SlotLeases(redis)


FREED_BY_A = Message(b"trio-failover:freed", b"gpu-1 replica-a")


async def test_capacity_one_refuses_a_second_take_and_release_frees_it(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(LIMIT):
        async with watching_freed(redis_server) as (subscription, leases):
            take = await leases.take("gpu-1", "a", capacity=1, ttl=TTL, deadline=soon())
            assert take == LeaseTake(taken=True, in_flight=1)
            refused = await leases.take("gpu-1", "b", capacity=1, ttl=TTL, deadline=soon())
            assert not refused.taken
            assert refused.in_flight == 1
            assert TTL - 1 < refused.retry_after <= TTL
            # Another node's slots are its own.
            assert (await leases.take("gpu-2", "b", capacity=1, ttl=TTL, deadline=soon())).taken
            assert await leases.in_flight("gpu-1", deadline=soon()) == 1

            assert await release(leases, "gpu-1", "a") is True
            assert await next_message(subscription) == FREED_BY_A
            assert await leases.in_flight("gpu-1", deadline=soon()) == 0
            assert (await leases.take("gpu-1", "b", capacity=1, ttl=TTL, deadline=soon())).taken
            # A second release of the same lease finds nothing and announces nothing.
            assert await release(leases, "gpu-1", "a") is False
            assert await release(leases, "gpu-1", "b") is True
            assert await next_message(subscription) == FREED_BY_A


async def test_a_release_is_announced_only_when_a_waiter_may_hope_for_it(
    redis_server: RedisServer,
) -> None:
    """Announced when the node was full before the release, or the replica saw it full."""
    with trio.fail_after(LIMIT):
        async with watching_freed(redis_server) as (subscription, leases):

            async def take(node: str, lease: str) -> None:
                assert (await leases.take(node, lease, capacity=3, ttl=TTL, deadline=soon())).taken

            for lease in ("a", "b"):
                await take("gpu-1", lease)
            await take("gpu-2", "c")
            assert await release(leases, "gpu-1", "a", capacity=3) is True  # 2 of 3: room left
            # Seen full (an engine's own count said so): announced all the same.
            assert await release(leases, "gpu-2", "c", capacity=3, seen_full=True) is True
            for lease in ("d", "e"):
                await take("gpu-1", lease)
            assert await release(leases, "gpu-1", "b", capacity=3) is True  # 3 of 3: full
            # The first release said nothing: the messages are the second's and the third's.
            assert await next_message(subscription) == Message(
                b"trio-failover:freed", b"gpu-2 replica-a"
            )
            assert await next_message(subscription) == FREED_BY_A


async def test_taking_a_held_lease_again_does_not_count_twice(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            leases = SlotLeases(redis)
            for _ in range(3):
                take = await leases.take("n", "same", capacity=2, ttl=TTL, deadline=soon())
                assert take == LeaseTake(taken=True, in_flight=1)
            # At capacity, the holder's retry is still taken: it is a renewal.
            assert (await leases.take("n", "other", capacity=2, ttl=TTL, deadline=soon())).taken
            assert (await leases.take("n", "same", capacity=2, ttl=TTL, deadline=soon())).taken
            assert not (await leases.take("n", "third", capacity=2, ttl=TTL, deadline=soon())).taken


async def test_capacity_zero_has_no_limit_but_counts(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            leases = SlotLeases(redis)
            for index in range(5):
                take = await leases.take("n", f"l{index}", capacity=0, ttl=TTL, deadline=soon())
                assert take == LeaseTake(taken=True, in_flight=index + 1)


async def test_a_lease_past_its_ttl_frees_itself_and_is_announced(
    redis_server: RedisServer,
) -> None:
    ttl = 0.3
    with trio.fail_after(LIMIT):
        async with watching_freed(redis_server) as (subscription, leases):
            # A long lease keeps the node's key alive however late this test
            # runs on (the key itself expires a TTL after its last lease).
            assert (await leases.take("gpu-1", "kept", capacity=2, ttl=TTL, deadline=soon())).taken
            # The holder takes and then dies: nobody releases.
            assert (await leases.take("gpu-1", "dead", capacity=2, ttl=ttl, deadline=soon())).taken
            refused = await leases.take("gpu-1", "waiter", capacity=2, ttl=ttl, deadline=soon())
            assert not refused.taken
            assert 0 < refused.retry_after <= ttl
            await trio.sleep(refused.retry_after + 0.002)  # Redis counts in whole ms
            take = await leases.take("gpu-1", "waiter", capacity=2, ttl=ttl, deadline=soon())
            assert take == LeaseTake(taken=True, in_flight=2)
            # The take that found the dead lease expired said so to every replica.
            assert await next_message(subscription) == Message(b"trio-failover:freed", b"gpu-1")
            assert await leases.renew("gpu-1", "dead", ttl=ttl, deadline=soon()) is False


async def test_renewal_keeps_the_lease_and_a_lapsed_one_is_gone(redis_server: RedisServer) -> None:
    ttl = 0.3
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            leases = SlotLeases(redis)
            assert (await leases.take("n", "kept", capacity=1, ttl=ttl, deadline=soon())).taken
            assert await leases.renew("n", "kept", ttl=TTL, deadline=soon()) is True
            await trio.sleep(ttl + 0.05)
            refused = await leases.take("n", "other", capacity=1, ttl=ttl, deadline=soon())
            assert not refused.taken  # renewed past the first TTL
            assert refused.retry_after > TTL - 1
            assert await leases.renew("n", "never-taken", ttl=TTL, deadline=soon()) is False


async def test_the_set_outlives_its_last_lease_by_one_ttl(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            leases = SlotLeases(redis, prefix="fleet-b:")
            await leases.take("n", "a", capacity=1, ttl=10.0, deadline=soon())
            key = slots_key("fleet-b:", "n")
            assert await redis.execute("EXISTS", key, deadline=soon()) == 1
            pttl = await redis.execute("PTTL", key, deadline=soon())
            assert isinstance(pttl, int)
            assert 19_000 < pttl <= 20_000
            assert (
                await redis.execute("EXISTS", slots_key("trio-failover:", "n"), deadline=soon())
                == 0
            )


async def test_two_concurrent_takers_never_both_get_the_last_slot(
    redis_server: RedisServer,
) -> None:
    """Two connections (two replicas) race for one slot, round after round.

    Each round starts on both at once (a barrier), two takes per replica,
    so four takes of one slot are in flight together.
    """
    rounds = 40
    winners: dict[int, list[str]] = {index: [] for index in range(rounds)}
    with trio.fail_after(LIMIT):
        async with (
            await open_redis(redis_server.address, deadline=soon()) as one,
            await open_redis(redis_server.address, deadline=soon()) as two,
        ):
            arrived = 0
            go = [trio.Event() for _ in range(rounds)]

            async def take(leases: SlotLeases, index: int, lease: str) -> None:
                result = await leases.take(
                    f"node-{index}", lease, capacity=1, ttl=TTL, deadline=soon()
                )
                if result.taken:
                    winners[index].append(lease)

            async def replica(name: str, redis: RedisConnection) -> None:
                nonlocal arrived
                leases = SlotLeases(redis)
                for index in range(rounds):
                    arrived += 1
                    if arrived % 2 == 0:
                        go[index].set()  # the second replica at this round starts both
                    await go[index].wait()
                    async with trio.open_nursery() as nursery:
                        for attempt in range(2):
                            nursery.start_soon(take, leases, index, f"{name}-{attempt}")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(replica, "a", one)
                nursery.start_soon(replica, "b", two)
    assert all(len(won) == 1 for won in winners.values()), winners


async def test_a_waiter_on_every_replica_hears_of_the_freed_slot(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(LIMIT):
        async with contextlib.AsyncExitStack() as stack:
            subscriptions = [
                await stack.enter_async_context(
                    await open_subscription(
                        redis_server.address, ["trio-failover:freed"], deadline=soon()
                    )
                )
                for _ in range(3)
            ]
            redis = await stack.enter_async_context(
                await open_redis(redis_server.address, deadline=soon())
            )
            leases = SlotLeases(redis)
            for lease in ("l0", "l1"):
                await leases.take("gpu-1", lease, capacity=2, ttl=TTL, deadline=soon())
            assert await release(leases, "gpu-1", "l0", capacity=2)
            for subscription in subscriptions:
                assert await next_message(subscription) == FREED_BY_A


@pytest.mark.parametrize("capacity", [1, 3])
async def test_the_count_never_passes_capacity_under_churn(
    redis_server: RedisServer, capacity: int
) -> None:
    """Many tasks on two connections take, hold a moment and release, at random."""
    held: set[str] = set()
    most = 0
    with trio.fail_after(LIMIT):
        async with (
            await open_redis(redis_server.address, deadline=soon()) as one,
            await open_redis(redis_server.address, deadline=soon()) as two,
        ):

            async def worker(name: str, redis: RedisConnection) -> None:
                nonlocal most
                leases = SlotLeases(redis)
                for turn in range(15):
                    lease = f"{name}-{turn}"
                    take = await leases.take(
                        "n", lease, capacity=capacity, ttl=TTL, deadline=soon()
                    )
                    if not take.taken:
                        await trio.lowlevel.checkpoint()
                        continue
                    held.add(lease)
                    most = max(most, len(held))
                    await trio.lowlevel.checkpoint()
                    held.discard(lease)
                    assert await release(leases, "n", lease, capacity=capacity)

            async with trio.open_nursery() as nursery:
                for index in range(8):
                    nursery.start_soon(worker, f"w{index}", one if index % 2 else two)
    assert 1 <= most <= capacity


async def test_a_replica_that_stopped_beating_has_its_leases_freed_once_each_announced(
    redis_server: RedisServer,
) -> None:
    """Replica b beats once for 0.3 s and holds three leases; a judges it dead and reaps.

    The waits are for b's beat to expire, by what Redis said of it (never guessed).
    """
    with trio.fail_after(LIMIT):
        async with watching_freed(redis_server) as (subscription, leases):
            records = SharedRecords(leases.connection)
            first = await records.heartbeat("a", TTL, deadline=soon())
            assert first.previous_ms is None  # a's first beat
            assert (await records.heartbeat("b", 0.3, deadline=soon())).live == 2
            for node, lease in [("gpu-1", "b:1"), ("gpu-1", "b:2"), ("gpu-2", "b:3")]:
                assert (await leases.take(node, lease, capacity=3, ttl=TTL, deadline=soon())).taken
            assert (await leases.take("gpu-2", "a:1", capacity=3, ttl=TTL, deadline=soon())).taken
            beats = await records.heartbeat("a", TTL, deadline=soon())
            assert not beats.lapsed
            await trio.sleep((beats.expiries["b"] - beats.now_ms + 2) / 1000)
            beats = await records.heartbeat("a", TTL, deadline=soon())
            assert beats.live == 1
            assert "b" in beats.expiries  # left for the reap, with its leases
            verdict = state_layout.judge(beats, "a", first.now_ms, 30_000)
            assert verdict == state_layout.Verdict(dead=("b",))
            holders = await leases.holders(["gpu-1", "gpu-2", "gpu-3"], deadline=soon())
            assert {node: sorted(ids) for node, ids in holders.items()} == {
                "gpu-1": ["b:1", "b:2"],
                "gpu-2": ["a:1", "b:3"],
                "gpu-3": [],
            }
            freed = state_layout.leases_to_free(verdict.dead, holders)
            assert await leases.reap(verdict.dead, freed, deadline=soon()) == {"b": 3}
            for node in (b"gpu-1", b"gpu-1", b"gpu-2"):  # one announcement per lease
                assert await next_message(subscription) == Message(b"trio-failover:freed", node)
            assert await leases.in_flight("gpu-1", deadline=soon()) == 0
            assert await leases.in_flight("gpu-2", deadline=soon()) == 1  # a's own
            # Another replica that judged the same death frees nothing twice.
            assert await leases.reap(verdict.dead, freed, deadline=soon()) == {}
            assert "b" not in (await records.heartbeat("a", TTL, deadline=soon())).expiries
            assert await leases.take("gpu-2", "a:2", capacity=3, ttl=TTL, deadline=soon())
            await leases.connection.execute("PING", deadline=soon())
            with trio.move_on_after(0.1):  # nothing more was announced
                message = await subscription.__anext__()
                raise AssertionError(f"announced again: {message}")


async def test_a_replica_that_beat_again_since_it_was_judged_keeps_its_leases(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            leases, records = SlotLeases(redis), SharedRecords(redis)
            await records.heartbeat("a", TTL, deadline=soon())
            beats = await records.heartbeat("c", 0.3, deadline=soon())
            assert (await leases.take("gpu-1", "c:1", capacity=1, ttl=TTL, deadline=soon())).taken
            await trio.sleep((beats.expiries["c"] - beats.now_ms + 2) / 1000)
            beats = await records.heartbeat("a", TTL, deadline=soon())
            assert state_layout.judge(beats, "a", 0, 30_000).dead == ("c",)
            again = await records.heartbeat("c", TTL, deadline=soon())  # c was only slow
            assert again.lapsed  # and c knows it: it takes its leases again
            holders = await leases.holders(["gpu-1"], deadline=soon())
            freed = state_layout.leases_to_free(["c"], holders)
            assert await leases.reap(["c"], freed, deadline=soon()) == {}
            assert await leases.in_flight("gpu-1", deadline=soon()) == 1
