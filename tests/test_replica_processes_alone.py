"""Real replica processes going on alone while Redis is away: each within its share.

Two replicas of one node of capacity 2 have a share of 1 each while Redis
is away (the capacity divided by the live replicas each last counted), so
that the two together never put more than the capacity on the node. The
node holds each request until the test lets that one go; a replica's
``/events`` says when a workload of it waits. Every wait is for an event,
bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio
import trio_websocket
from conftest import RedisServer
from support import ProxyProcess
from test_replica_processes import LIMIT, admin_of, joined, state_options

from trio_failover.testing import FakeNode, Fleet, request_tcp

COUNT = re.compile(r"\breplicas=(\d+)")
COUNTED = 10.0  # seconds for both replicas to count each other (a beat each second)


@attrs.define
class Gated:
    """A node's behaviour that holds each request until the test lets that one go.

    A request names itself in its body (``"n"``); ``now`` and ``most``
    count the requests held at once.
    """

    now: int = 0
    most: int = 0
    started: dict[int, float] = attrs.Factory(dict)
    gates: defaultdict[int, trio.Event] = attrs.Factory(lambda: defaultdict(trio.Event))
    _changed: trio.Event = attrs.Factory(trio.Event)

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    def _told(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def __call__(self, io: Any, request: Any) -> None:
        number = request.json()["n"]
        self.now += 1
        self.most = max(self.most, self.now)
        self.started[number] = trio.current_time()
        self._told()
        try:
            await self.gates[number].wait()
            await io.send(h11.Response(status_code=200, headers=[(b"content-length", b"2")]))
            await io.send(h11.Data(data=b"{}"), h11.EndOfMessage())
        finally:
            self.now -= 1
            self._told()


def body(number: int) -> bytes:
    return json.dumps({"model": "m", "stream": True, "n": number}).encode()


@attrs.define
class Waits:
    """The ``queued`` events with a position (a workload starts to wait) of one replica."""

    count: int = 0
    _changed: trio.Event = attrs.Factory(trio.Event)

    async def watch(self, admin: tuple[str, int], task_status: Any) -> None:
        async with trio_websocket.open_websocket(*admin, "/events", use_ssl=False) as ws:
            task_status.started()
            while True:
                event = json.loads(await ws.get_message())
                if event.get("state") == "queued" and "position" in event:
                    self.count += 1
                    self._changed.set()
                    self._changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while self.count < count:
            await self._changed.wait()


async def until_counted(replica: ProxyProcess, replicas: int) -> None:
    """Until the replica's last count of the live replicas is ``replicas`` (bound it).

    Its log says each count: at a join (``joined``), and at each change
    (``live replicas``).
    """
    while True:
        counts = [COUNT.search(line) for line in replica.lines if "shared state" in line]
        found = [int(count[1]) for count in counts if count]
        if found and found[-1] == replicas:
            return
        await replica.lines.wait_for("shared state", after=len(replica.lines))


async def first_of(*waits: Callable[[], Any]) -> None:
    """Return once any of the waits has returned."""
    async with trio.open_nursery() as nursery:

        async def one(wait: Callable[[], Any]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(one, wait)


@attrs.define
class Scene:
    """Replica A of two, a node of capacity 2 behind them, and A's waits as they come."""

    a: ProxyProcess
    gated: Gated
    waits: Waits
    nursery: trio.Nursery
    answers: list[int] = attrs.Factory(list)

    def send(self, number: int) -> None:
        """Request ``number`` through A, answered in its own task."""
        self.nursery.start_soon(self._send, number)

    async def _send(self, number: int) -> None:
        response = await request_tcp(self.a.address, body=body(number))
        assert response is not None
        self.answers.append(response.status)


@asynccontextmanager
async def capacity_two(redis_server: RedisServer) -> AsyncIterator[Scene]:
    """Two replicas that count each other, before a node of capacity 2; ends when all answered."""
    gated = Gated()
    async with Fleet({"gpu-1": FakeNode(gated)}) as fleet:
        node = await fleet.serve_tcp("gpu-1")
        more = (f"--upstream=gpu-1={node.url}", "--capacity=2", "--queue-timeout=30s")
        async with joined(*state_options(redis_server, *more)) as (a, b):
            with trio.fail_after(COUNTED):
                await until_counted(a, 2)
                await until_counted(b, 2)
            waits = Waits()
            async with trio.open_nursery() as watching:
                await watching.start(waits.watch, await admin_of(a))
                async with trio.open_nursery() as nursery:
                    yield Scene(a, gated, waits, nursery)
                watching.cancel_scope.cancel()


async def test_while_redis_is_away_a_replica_runs_only_its_share_of_a_capacity(
    redis_server: RedisServer,
) -> None:
    """Capacity 2, two replicas: while Redis is away A runs one request; its second waits.

    Against the whole capacity instead of its share, A would run both, and
    B could do the same: four at a node of two.
    """
    with trio.fail_after(LIMIT):
        async with capacity_two(redis_server) as scene:
            gated = scene.gated
            redis_server.stop()
            with trio.fail_after(10):
                await scene.a.lines.wait_for("shared state unreachable")
            scene.send(1)
            await gated.wait_for(lambda: gated.now == 1)
            scene.send(2)
            # Either A holds the second back (it waits), or both run.
            await first_of(
                lambda: scene.waits.wait_for(1),
                lambda: gated.wait_for(lambda: gated.now == 2),
            )
            assert gated.now == 1, "a replica alone ran more than its share"
            gated.gates[1].set()
            await gated.wait_for(lambda: 2 in gated.started)
            gated.gates[2].set()
        assert scene.answers == [200, 200]
        assert gated.most == 1


async def test_a_lease_kept_when_an_attempt_ends_during_an_outage_does_not_pass_the_share(
    redis_server: RedisServer,
) -> None:
    """Capacity 2: A runs two requests (two leases in Redis), then Redis goes away.

    A third request through A waits in A's queue (the node is full here).
    When the first ends, its lease was taken in Redis: it may be kept as
    the node's spare, but the third must not run on it while Redis is
    away, where A's share is 1 and the second still runs: it waits again,
    and runs once the second has ended.
    """
    with trio.fail_after(LIMIT):
        async with capacity_two(redis_server) as scene:
            gated = scene.gated
            scene.send(1)
            scene.send(2)
            await gated.wait_for(lambda: gated.now == 2)  # both leases in Redis
            redis_server.stop()
            with trio.fail_after(10):
                await scene.a.lines.wait_for("shared state unreachable")
            scene.send(3)
            await scene.waits.wait_for(1)  # A's node is full: the third waits
            gated.gates[1].set()
            # The first's end hands its slot to the third: within its share
            # (1, the second still runs) it waits again; on a spare it would run.
            await first_of(
                lambda: scene.waits.wait_for(2),
                lambda: gated.wait_for(lambda: 3 in gated.started),
            )
            assert 3 not in gated.started, "a spare lease let A past its share"
            gated.gates[2].set()
            await gated.wait_for(lambda: 3 in gated.started)
            gated.gates[3].set()
        assert scene.answers == [200, 200, 200]
        assert gated.most == 2  # the first two, before Redis went
