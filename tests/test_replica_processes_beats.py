"""Real replica processes and their heartbeat: a dead replica's slots, and the live count.

A replica beats every second, and its beat lasts three; the others free
the slot leases of one that stopped, within 5 s of its death, and count
only the beating ones. Each replica is its own process over a real
redis-server; the node is a fake one on a loopback socket. Every wait is
for an event (the node's, a line of a replica's log, an event on its
``/events``), each bounded by ``trio.fail_after``; the bounds asserted are
the promises themselves, measured from the ``kill -9``.
"""

from __future__ import annotations

import contextlib

import trio
from conftest import RedisServer
from support import serve_process
from test_replica_processes import LIMIT, STREAM, admin_of, state_options, status_of
from test_replica_processes_alone import COUNTED, Waits, until_counted

from trio_failover.testing import FakeNode, Fleet, HeldRequests, request_tcp

PROMISE = 5.0  # seconds from a replica's death to its slots free, and its count gone


async def test_kill_9_of_a_replica_holding_both_slots_frees_them_within_five_seconds(
    redis_server: RedisServer,
) -> None:
    """Capacity 2, the default 30 s lease TTL: A holds both slots and is killed.

    B's request that waited, and one sent after the kill, both reach the
    node within 5 s of the kill, not at the leases' expiry 30 s later.
    """
    held = HeldRequests(leave_with_client=True)  # A's requests end with its connections
    with trio.fail_after(LIMIT):
        async with Fleet({"gpu-1": FakeNode(held.behaviour())}) as fleet:
            node = await fleet.serve_tcp("gpu-1")
            more = (f"--upstream=gpu-1={node.url}", "--capacity=2", "--queue-timeout=30s")
            options = state_options(redis_server, *more)
            async with serve_process(*options) as a, serve_process(*options) as b:
                with trio.fail_after(10):
                    await a.lines.wait_for("shared state: joined")
                    await b.lines.wait_for("shared state: joined")
                answers: list[int] = []
                waits = Waits()

                async def through_a() -> None:
                    with contextlib.suppress(OSError, trio.BrokenResourceError):
                        await request_tcp(a.address, body=STREAM)  # killed under it

                async def through_b() -> None:
                    response = await request_tcp(b.address, body=STREAM)
                    assert response is not None
                    answers.append(response.status)

                async with trio.open_nursery() as watching:
                    await watching.start(waits.watch, await admin_of(b))
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(through_a)
                        nursery.start_soon(through_a)
                        await held.wait_for(lambda: held.now == 2)  # A holds both slots
                        nursery.start_soon(through_b)
                        await waits.wait_for(1)  # refused: it waits in B's queue
                        a.process.kill()  # SIGKILL: A's leases are never released
                        killed = trio.current_time()
                        nursery.start_soon(through_b)
                        await held.wait_for(lambda: len(held.started) == 4)
                        started = [at - killed for at in held.started[2:]]
                        held.let_all_go()
                    watching.cancel_scope.cancel()
                assert answers == [200, 200]
                assert held.most == 2  # never more than the capacity
                assert max(started) < PROMISE, started
                line = await b.lines.wait_for("stopped beating")
                assert "freed=2" in line


async def test_replicas_count_the_beating_ones_a_dead_one_drops_out_and_a_rejoin_agrees(
    redis_server: RedisServer,
) -> None:
    """Three replicas; C is killed; then Redis restarts empty and A and B rejoin.

    Both count 2 within 5 s of C's death, and again within 2 s of the later
    rejoin (the one that rejoined first counted itself alone).
    """
    with trio.fail_after(LIMIT + 20):
        async with Fleet({"gpu-1": FakeNode(HeldRequests().behaviour())}) as fleet:
            node = await fleet.serve_tcp("gpu-1")
            options = state_options(redis_server, f"--upstream=gpu-1={node.url}")
            async with (
                serve_process(*options) as a,
                serve_process(*options) as b,
                serve_process(*options) as c,
            ):
                with trio.fail_after(COUNTED):
                    for replica in (a, b, c):
                        await until_counted(replica, 3)
                c.process.kill()
                killed = trio.current_time()
                for replica in (a, b):
                    with trio.fail_after(PROMISE + 1):  # to fail with a message, not hang
                        await until_counted(replica, 2)
                    assert trio.current_time() - killed < PROMISE
                redis_server.stop()
                for replica in (a, b):
                    with trio.fail_after(10):
                        await replica.lines.wait_for("shared state unreachable")
                redis_server.start()  # empty: every replica's beat is gone
                for replica in (a, b):
                    with trio.fail_after(10):  # the rejoin tries every 5 s by now
                        await replica.lines.wait_for("shared state: rejoined")
                rejoined = trio.current_time()
                for replica in (a, b):
                    with trio.fail_after(COUNTED):
                        await until_counted(replica, 2)
                    assert trio.current_time() - rejoined < 2.0
                for replica in (a, b):
                    state = (await status_of(await admin_of(replica)))["state"]
                    assert state == {"backend": "redis", "connected": True, "replicas": 2}
