"""Real replica processes (``trio-failover serve --state redis://...``) over a real redis-server.

The nodes are fake ones on real 127.0.0.1 sockets; each replica is its own
process (``support.serve_process``). Waits are for events (the node's, a
line of a replica's log, an event on a replica's ``/events``), each bounded
by ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_websocket
from conftest import RedisServer
from support import ProxyProcess, serve_process

from trio_failover.core.state_layout import freed_channel, slots_key
from trio_failover.testing import (
    FakeNode,
    Fleet,
    HeldRequests,
    frozen,
    healthy,
    request_tcp,
)
from trio_failover.wire.redis import open_redis, open_subscription

LIMIT = 40.0
SLACK = 1.5  # how late things happen on a busy two-core machine with three processes
TTL = 2.0
STREAM = b'{"model": "m", "stream": true}'


async def test_kill_9_of_a_replica_holding_a_slot_frees_it_within_one_lease_ttl(
    redis_server: RedisServer,
) -> None:
    held = HeldRequests(leave_with_client=True)
    with trio.fail_after(LIMIT):
        async with Fleet({"gpu-1": FakeNode(held.behaviour())}) as fleet:
            node = await fleet.serve_tcp("gpu-1")
            options = (
                f"--upstream=gpu-1={node.url}",
                "--capacity=1",
                f"--state=redis://127.0.0.1:{redis_server.port}",
                f"--lease-ttl={TTL:g}s",
                "--queue-timeout=30s",
                "--discovery-interval=0",  # the node sees only the test's requests
            )
            async with serve_process(*options) as a, serve_process(*options) as b:
                with trio.fail_after(10):
                    await a.lines.wait_for("shared state: joined")
                    await b.lines.wait_for("shared state: joined")
                answers: list[int] = []
                async with trio.open_nursery() as nursery:

                    async def through_a() -> None:
                        with contextlib.suppress(OSError, trio.BrokenResourceError):
                            await request_tcp(a.address, body=STREAM)  # killed under it

                    nursery.start_soon(through_a)
                    await held.wait_for(lambda: held.now == 1)
                    a.process.kill()  # SIGKILL: its lease is never released
                    killed = trio.current_time()

                    async def through_b() -> None:
                        response = await request_tcp(b.address, body=STREAM)
                        assert response is not None
                        answers.append(response.status)

                    nursery.start_soon(through_b)
                    await held.wait_for(lambda: len(held.started) == 2)
                    took = held.started[1] - killed
                    held.let_all_go()
                assert answers == [200]
                assert held.most == 1  # never two at once: B waited for the lease
                # B waited for A's lease to lapse, and no longer than one TTL.
                assert took > TTL / 4
                assert took < TTL + SLACK


# -- a node frozen for one replica, capacity across two, Redis away -----------------------


def state_options(redis_server: RedisServer, *more: str) -> tuple[str, ...]:
    return (
        f"--state=redis://127.0.0.1:{redis_server.port}",
        "--discovery-interval=0",  # the nodes see only the test's requests
        "--admin-listen=127.0.0.1:0",  # after support's "off": the last one counts
        *more,
    )


async def admin_of(replica: ProxyProcess) -> tuple[str, int]:
    line = await replica.lines.wait_for("admin on http://")
    found = re.search(r"admin on http://(\S+?):(\d+)\b", line)
    assert found is not None, line
    return found[1], int(found[2])


async def status_of(admin: tuple[str, int]) -> dict[str, Any]:
    response = await request_tcp(admin, "GET", "/status")
    assert response is not None
    assert response.status == 200
    status: dict[str, Any] = response.json()
    return status


@contextlib.asynccontextmanager
async def joined(*options: str) -> AsyncIterator[tuple[ProxyProcess, ProxyProcess]]:
    """Two replicas, each once it joined the shared state."""
    async with serve_process(*options) as a, serve_process(*options) as b:
        with trio.fail_after(10):
            await a.lines.wait_for("shared state: joined")
            await b.lines.wait_for("shared state: joined")
        yield a, b


async def test_a_node_frozen_for_replica_a_is_skipped_by_replica_bs_next_request(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(frozen()), "gpu-2": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet:
            one, two = await fleet.serve_tcp("gpu-1"), await fleet.serve_tcp("gpu-2")
            options = state_options(
                redis_server,
                f"--upstream=gpu-1={one.url}",
                f"--upstream=gpu-2={two.url}",
                "--response-header-timeout=500ms",
            )
            async with joined(*options) as (a, b):
                first = await request_tcp(a.address, body=STREAM)
                assert first is not None
                assert (first.status, first.header("x-failover-node")) == (200, "gpu-2")
                assert first.header("x-failover-attempts") == "2"  # gpu-1 froze, then gpu-2
                assert len(nodes["gpu-1"].received) == 1
                # B applied A's cooldown of gpu-1 (its own log says so).
                with trio.fail_after(10):
                    line = await b.lines.wait_for("cooldown")
                assert "gpu-1" in line
                second = await request_tcp(b.address, body=STREAM)
                assert second is not None
                assert second.status == 200
                # One attempt: straight to gpu-2; gpu-1 was never asked again.
                assert second.header("x-failover-node") == "gpu-2"
                assert second.header("x-failover-attempts") == "1"
                assert len(nodes["gpu-1"].received) == 1
                assert len(nodes["gpu-2"].received) == 2


async def first_queued(*admins: tuple[str, int], task_status: Any) -> tuple[str, int]:
    """The admin address of the replica whose workload waits first (a ``queued`` event)."""
    found: list[tuple[str, int]] = []
    async with trio.open_nursery() as nursery:
        sockets: list[trio_websocket.WebSocketConnection] = []

        async def watch(admin: tuple[str, int], task_status: Any) -> None:
            async with trio_websocket.open_websocket(*admin, "/events", use_ssl=False) as ws:
                sockets.append(ws)
                task_status.started()
                while True:
                    event = json.loads(await ws.get_message())
                    if event.get("state") == "queued" and "position" in event:
                        found.append(admin)
                        nursery.cancel_scope.cancel()

        for admin in admins:
            await nursery.start(watch, admin)
        task_status.started()  # subscribed to both: the requests may go
    return found[0]


async def test_capacity_one_across_two_replica_processes_one_waits_and_runs_at_once(
    redis_server: RedisServer,
) -> None:
    held = HeldRequests(leave_with_client=True)
    with trio.fail_after(LIMIT):
        async with Fleet({"gpu-1": FakeNode(held.behaviour())}) as fleet:
            node = await fleet.serve_tcp("gpu-1")
            # The default 30 s TTL: a refused take asks again after 5 s at the
            # earliest, so a waiter that runs within SLACK was woken by the
            # announcement of the freed slot.
            more = (f"--upstream=gpu-1={node.url}", "--capacity=1", "--queue-timeout=30s")
            async with joined(*state_options(redis_server, *more)) as (a, b):
                admins = {await admin_of(a): a, await admin_of(b): b}
                answers: list[tuple[str, int]] = []
                queued: list[tuple[str, int]] = []
                async with trio.open_nursery() as nursery:

                    async def watch(task_status: Any) -> None:
                        queued.append(await first_queued(*admins, task_status=task_status))
                        watching.cancel_scope.cancel()

                    async def send(replica: ProxyProcess) -> None:
                        response = await request_tcp(replica.address, body=STREAM)
                        assert response is not None
                        answers.append(
                            (response.header("x-failover-attempts") or "", response.status)
                        )

                    async def two_at_once() -> None:
                        await held.wait_for(lambda: held.most > 1)
                        watching.cancel_scope.cancel()  # neither waits: fail at once

                    async with trio.open_nursery() as watching:
                        await watching.start(watch)
                        watching.start_soon(two_at_once)
                        nursery.start_soon(send, a)
                        nursery.start_soon(send, b)
                    # The waiter's event can come before the other request reaches the node.
                    assert held.most <= 1, "both requests ran at the node at once"
                    await held.wait_for(lambda: held.now == 1)
                    # One runs at the node, the other waits in its replica's queue.
                    waiting = await status_of(queued[0])
                    assert waiting["queued"] == 1
                    assert len(held.started) == 1
                    held.let_all_go()  # both answer as soon as they run
                    await held.wait_for(lambda: len(held.ended) == 2)
                assert sorted(answers) == [("1", 200), ("1", 200)]
                assert held.most == 1  # never two at once at the node
                # The waiter ran as soon as the other ended: woken by the announcement.
                assert held.started[1] - held.ended[0] < SLACK
                assert held.started[1] >= held.ended[0]
                for admin in admins:
                    state = (await status_of(admin))["state"]
                    assert (state["backend"], state["connected"]) == ("redis", True)


async def leases_at(redis_server: RedisServer, node: str) -> int:
    deadline = trio.current_time() + 5
    connection = await open_redis(redis_server.address, deadline=deadline)
    try:
        reply = await connection.execute(
            "ZCARD", slots_key("trio-failover:", node), deadline=deadline
        )
    finally:
        await connection.aclose()
    assert isinstance(reply, int)
    return reply


AWAY = 10.0  # seconds Redis is stopped
ANSWER = 3.0  # seconds a request may take while it is: far more than it does


async def test_redis_stopped_for_ten_seconds_both_replicas_serve_alone_and_rejoin(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet:
            node = await fleet.serve_tcp("gpu-1")
            # A heartbeat each second; capacity 1 is a share of 1 each while away
            # (at least 1), and full while a request runs: its release is announced.
            more = (f"--upstream=gpu-1={node.url}", "--capacity=1", "--lease-ttl=3s")
            async with joined(*state_options(redis_server, *more)) as (a, b):
                admins = [await admin_of(a), await admin_of(b)]
                redis_server.stop()
                for replica, admin in zip((a, b), admins, strict=True):
                    with trio.fail_after(10):
                        await replica.lines.wait_for("shared state unreachable")
                    state = (await status_of(admin))["state"]
                    assert (state["backend"], state["connected"]) == ("redis", False)
                away_until = trio.current_time() + AWAY
                served = 0
                while trio.current_time() < away_until:  # ten seconds without Redis
                    for replica in (a, b):
                        with trio.fail_after(ANSWER):  # no request waits for Redis
                            response = await request_tcp(replica.address, body=STREAM)
                        assert response is not None
                        assert response.status == 200
                        assert response.body == b"hi"
                        served += 1
                    with trio.move_on_at(away_until):
                        await trio.sleep(0.25)  # pacing the requests, not waiting for anything
                assert served >= 8
                redis_server.start()  # on the same port, empty: nothing was saved
                for replica in (a, b):
                    with trio.fail_after(10):  # the rejoin tries every 5 s by now
                        await replica.lines.wait_for("shared state: rejoined")
                for admin in admins:
                    state = (await status_of(admin))["state"]
                    assert (state["backend"], state["connected"]) == ("redis", True)
                # A replica releases its lease after the response's end: the test
                # waits for both releases' announcements before it counts leases.
                freed = await open_subscription(
                    redis_server.address,
                    [freed_channel("trio-failover:")],
                    deadline=trio.current_time() + 5,
                )
                async with freed:
                    for replica in (a, b):
                        response = await request_tcp(replica.address, body=STREAM)
                        assert response is not None
                        assert response.status == 200
                        with trio.fail_after(5):
                            message = await freed.__anext__()
                        assert message.data.startswith(b"gpu-1 ")  # and the replica's id
                # Each request reached the node once, and no replica's lease stayed behind.
                assert len(nodes["gpu-1"].received) == served + 2
                assert await leases_at(redis_server, "gpu-1") == 0
                for replica in (a, b):
                    assert sum("shared state unreachable" in line for line in replica.lines) == 1
