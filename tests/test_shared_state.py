"""proxy/fleet/shared_state.py against a real redis-server: records, snapshot, leases, Redis away.

Real 127.0.0.1 sockets and the real clock (real I/O is in flight, so no
autojump). Every wait is for an event (a callback, ``wait_changed``), each
bounded by ``trio.fail_after``; a redis-server is stopped and started to
take Redis away, and ``SIGSTOP``ped to make it accept and answer nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio
from conftest import LogRecords, RedisServer
from test_redis_wire import SilentServer

from trio_failover.core.redis_url import RedisAddress
from trio_failover.core.state_layout import LeaseTake, replicas_key
from trio_failover.proxy.fleet.shared_state import RemoteRecord, SharedState
from trio_failover.wire.redis import open_redis
from trio_failover.wire.slot_lease import SharedRecords, SlotLeases

LIMIT = 15.0
SLACK = 1.0  # how late a deadline may fire on a busy two-core machine
NODES = ("gpu-1", "gpu-2")


@attrs.define
class Seen:
    """What one replica's callbacks were told, with an event per arrival."""

    records: list[RemoteRecord] = attrs.Factory(list)
    freed: list[tuple[str, bool]] = attrs.Factory(list)
    snapshots: list[list[RemoteRecord]] = attrs.Factory(list)
    arrived: trio.Event = attrs.Factory(trio.Event)

    def _told(self) -> None:
        self.arrived.set()
        self.arrived = trio.Event()

    def on_record(self, record: RemoteRecord) -> None:
        self.records.append(record)
        self._told()

    def on_freed(self, node: str, mine: bool) -> None:
        self.freed.append((node, mine))
        self._told()

    def on_snapshot(self, records: list[RemoteRecord]) -> None:
        self.snapshots.append(records)
        self._told()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        with trio.fail_after(5):
            while not condition():
                await self.arrived.wait()


def replica(address: RedisAddress, seen: Seen, name: str, **kwargs: object) -> SharedState:
    return SharedState(
        address,
        NODES,
        replica_id=name,
        state_timeout=0.25,
        on_record=seen.on_record,
        on_freed=seen.on_freed,
        on_snapshot=seen.on_snapshot,
        **kwargs,  # type: ignore[arg-type]
    )


@asynccontextmanager
async def joined(*states: SharedState) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        for state in states:
            await nursery.start(state.run)
        yield
        nursery.cancel_scope.cancel()


async def wait_connected(state: SharedState, connected: bool, within: float = 10) -> None:
    with trio.fail_after(within):
        while state.connected != connected:
            await state.wait_changed()


async def test_records_reach_the_other_replicas_and_a_joiner_loads_the_snapshot(
    redis_server: RedisServer,
) -> None:
    seen_a, seen_b, seen_c = Seen(), Seen(), Seen()
    a = replica(redis_server.address, seen_a, "a")
    b = replica(redis_server.address, seen_b, "b")
    with trio.fail_after(LIMIT):
        async with joined(a, b):
            assert a.status() == {"backend": "redis", "connected": True, "replicas": 1}
            assert b.replicas == 2  # a's heartbeat was in when b joined
            record = {"kind": "cooldown", "key": "qwen3", "reason": "timeout", "remaining_s": 60.0}
            assert await a.publish(record, node="gpu-1") is True
            await seen_b.wait_for(lambda: bool(seen_b.records))
            assert seen_b.records == [RemoteRecord(origin="a", node="gpu-1", record=record)]
            # Told only, not stored: no node.
            assert await a.publish({"kind": "hello"}) is True
            await seen_b.wait_for(lambda: len(seen_b.records) == 2)
            assert seen_a.records == []  # a replica never hears its own
            # A later record of the same kind and key replaces the stored one.
            newer = {**record, "remaining_s": 30.0}
            assert await a.publish(newer, node="gpu-1") is True
            assert await a.publish({"kind": "down", "last_check": "ok"}, node="gpu-2") is True

            c = replica(redis_server.address, seen_c, "c")
            async with joined(c):
                ((*loaded,),) = seen_c.snapshots
                by_kind = {entry.record["kind"]: entry for entry in loaded}
                assert by_kind.keys() == {"cooldown", "down"}
                assert by_kind["cooldown"].record == newer
                assert by_kind["cooldown"].node == "gpu-1"
                assert 0 <= by_kind["cooldown"].age < 5
                assert c.replicas == 3


async def test_leases_hold_capacity_across_replicas_and_a_release_wakes_every_replica(
    redis_server: RedisServer,
) -> None:
    seen_a, seen_b = Seen(), Seen()
    a = replica(redis_server.address, seen_a, "a")
    b = replica(redis_server.address, seen_b, "b")
    with trio.fail_after(LIMIT):
        async with joined(a, b):
            lease_a, lease_b = a.new_lease_id(), b.new_lease_id()
            assert lease_a != b.new_lease_id() != lease_b
            assert await a.take_slot("gpu-1", lease_a, 1) == LeaseTake(taken=True, in_flight=1)
            refused = await b.take_slot("gpu-1", lease_b, 1)
            assert refused is not None
            assert not refused.taken
            assert await a.renew_slot("gpu-1", lease_a) is True
            # Posted: True once written; the slot was full, so it is announced,
            # to a as its own.
            assert await a.release_slot("gpu-1", lease_a, capacity=1, seen_full=False) is True
            await seen_b.wait_for(lambda: seen_b.freed == [("gpu-1", False)])
            await seen_a.wait_for(lambda: seen_a.freed == [("gpu-1", True)])
            taken = await b.take_slot("gpu-1", lease_b, 1)
            assert taken is not None
            assert taken.taken


async def test_renewals_keep_the_lease_past_its_ttl(redis_server: RedisServer) -> None:
    seen_a, seen_b = Seen(), Seen()
    a = replica(redis_server.address, seen_a, "a", lease_ttl=0.6)
    b = replica(redis_server.address, seen_b, "b", lease_ttl=0.6)
    with trio.fail_after(LIMIT):
        async with joined(a, b), trio.open_nursery() as holder:
            lease = a.new_lease_id()
            assert (await a.take_slot("gpu-1", lease, 1)) == LeaseTake(taken=True, in_flight=1)

            async def hold() -> None:  # as the fleet's renewing task does (fleet.py)
                while True:
                    await trio.sleep(a.lease_ttl / 3)
                    await a.renew_slot("gpu-1", lease)

            holder.start_soon(hold)
            # Past two TTLs the holder's renewals still keep b out...
            end = trio.current_time() + 1.5
            while trio.current_time() < end:
                refused = await b.take_slot("gpu-1", b.new_lease_id(), 1)
                assert refused is not None
                assert not refused.taken
                await trio.sleep(min(refused.retry_after, 0.3))
            # ...and once it stops, the lease lapses within one TTL.
            holder.cancel_scope.cancel()
            refused = await b.take_slot("gpu-1", "later", 1)
            assert refused is not None
            await trio.sleep(refused.retry_after + 0.01)
            taken = await b.take_slot("gpu-1", "later", 1)
            assert taken is not None
            assert taken.taken


async def test_redis_away_goes_on_alone_logs_once_and_rejoins(
    redis_server: RedisServer, logged: LogRecords
) -> None:
    seen = Seen()
    a = replica(redis_server.address, seen, "a", heartbeat_interval=0.2)
    b = replica(redis_server.address, Seen(), "b", heartbeat_interval=0.2)
    with trio.fail_after(LIMIT):
        async with joined(a, b):
            await wait_connected(a, True)
            assert a.replicas == 1
            with trio.fail_after(5):
                while a.replicas != 2:  # a's next heartbeat counts b
                    await a.wait_changed()
            assert a.share(3) == 1
            assert a.share(0) == 0
            redis_server.stop()
            await wait_connected(a, False)
            assert a.status() == {"backend": "redis", "connected": False, "replicas": 2}
            # Away: every call answers at once, and says "decide locally".
            start = trio.current_time()
            assert await a.take_slot("gpu-1", a.new_lease_id(), 1) is None
            assert await a.release_slot("gpu-1", "x", capacity=1, seen_full=True) is False
            assert await a.renew_slot("gpu-1", "x") is None
            assert await a.publish({"kind": "k"}) is False
            assert trio.current_time() - start < 0.1
            # A few failed rejoins later: still one line for the outage.
            await trio.sleep(1.0)
            warnings = [m for m in logged.messages(logging.WARNING) if "unreachable" in m]
            assert len(warnings) == 2  # one for each replica
            redis_server.start()
            await wait_connected(a, True)
            await wait_connected(b, True)
            assert a.joins == 2
            assert len(seen.snapshots) == 2
            assert (await a.take_slot("gpu-1", a.new_lease_id(), 1)) is not None
            assert [m for m in logged.messages(logging.WARNING) if "rejoined" in m]


async def test_a_redis_that_answers_nothing_delays_no_call_past_the_state_timeout(
    redis_server: RedisServer,
) -> None:
    a = replica(redis_server.address, Seen(), "a", heartbeat_interval=5.0)
    assert redis_server.process is not None
    pid = redis_server.process.pid
    with trio.fail_after(LIMIT):
        async with joined(a):
            await wait_connected(a, True)
            os.kill(pid, signal.SIGSTOP)  # accepts (the kernel does), answers nothing
            try:
                start = trio.current_time()
                assert await a.take_slot("gpu-1", a.new_lease_id(), 1) is None
                assert 0.25 <= trio.current_time() - start < 0.25 + SLACK
                # The timeout made the heartbeat probe at once (not in 5 s),
                # which timed out too.
                await wait_connected(a, False, within=1.0 + SLACK)
                start = trio.current_time()
                assert await a.take_slot("gpu-1", a.new_lease_id(), 1) is None
                assert trio.current_time() - start < 0.1
            finally:
                os.kill(pid, signal.SIGCONT)
            await wait_connected(a, True)


async def test_a_silent_server_from_the_start_is_bounded_and_never_joined() -> None:
    seen = Seen()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            silent = SilentServer()
            await nursery.start(silent.serve)
            a = replica(silent.address, seen, "a")
            start = trio.current_time()
            await nursery.start(a.run)
            assert 0.25 <= trio.current_time() - start < 0.25 + SLACK
            assert a.status() == {"backend": "redis", "connected": False, "replicas": 1}
            assert await a.take_slot("gpu-1", "x", 1) is None
            assert seen.snapshots == []
            nursery.cancel_scope.cancel()


async def test_a_clean_stop_leaves_the_live_count(redis_server: RedisServer) -> None:
    a = replica(redis_server.address, Seen(), "a", heartbeat_interval=5.0)
    b = replica(redis_server.address, Seen(), "b", heartbeat_interval=0.1)
    with trio.fail_after(LIMIT):
        async with joined(b):
            async with joined(a):
                assert a.replicas == 2
            # a left at once, not a heartbeat TTL (15 s) later.
            with trio.fail_after(5):
                while b.replicas != 1:
                    await b.wait_changed()


async def test_the_leases_of_a_replica_that_stopped_beating_are_freed_and_announced(
    redis_server: RedisServer, logged: LogRecords
) -> None:
    """x beats once (for 0.3 s) and takes two leases, as a replica killed right after would.

    a and b beat every 0.1 s: the first of them to beat after x's beat
    expired frees x's leases and announces each; both hear it.
    """
    seen_a, seen_b = Seen(), Seen()
    a = replica(redis_server.address, seen_a, "a", heartbeat_interval=0.1)
    b = replica(redis_server.address, seen_b, "b", heartbeat_interval=0.1)
    with trio.fail_after(LIMIT):
        async with (
            joined(a, b),
            await open_redis(redis_server.address, deadline=trio.current_time() + 5) as redis,
        ):
            leases = SlotLeases(redis)
            beat = await SharedRecords(redis).heartbeat("x", 0.3, deadline=trio.current_time() + 5)
            for node in NODES:
                take = await leases.take(
                    node, "x:1", capacity=1, ttl=30.0, deadline=trio.current_time() + 5
                )
                assert take.taken
            expired = trio.current_time() + (beat.expiries["x"] - beat.now_ms) / 1000
            for seen in (seen_a, seen_b):
                await seen.wait_for(lambda seen=seen: len(seen.freed) == 2)  # type: ignore[misc]
                assert sorted(seen.freed) == [("gpu-1", False), ("gpu-2", False)]
            # Within a beat of the expiry (and the machine's slack), not the lease's 30 s.
            assert trio.current_time() - expired < 0.1 + SLACK
            for node in NODES:
                assert await leases.in_flight(node, deadline=trio.current_time() + 5) == 0
            with trio.fail_after(5):
                while a.replicas != 2 or b.replicas != 2:
                    await a.wait_changed()
            told = [m for m in logged.messages(logging.WARNING) if "stopped beating" in m]
            assert len(told) == 1  # by whichever reaped it; the other found it gone


async def test_a_replica_whose_own_beat_lapsed_says_so(redis_server: RedisServer) -> None:
    """Another replica dropped it (judged it dead): its next beat finds itself gone."""
    a = replica(redis_server.address, Seen(), "a", heartbeat_interval=0.1)
    with trio.fail_after(LIMIT):
        async with (
            joined(a),
            await open_redis(redis_server.address, deadline=trio.current_time() + 5) as redis,
        ):
            await wait_connected(a, True)
            assert a.lapses == 0
            key = replicas_key("trio-failover:")
            assert await redis.execute("ZREM", key, "a", deadline=trio.current_time() + 5) == 1
            with trio.fail_after(5):
                while a.lapses == 0:
                    await a.wait_changed()
            assert a.lapses == 1
            assert a.connected
