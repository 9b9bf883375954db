"""Real replica processes (``trio-failover serve --state redis://...``) over a real redis-server.

The node is a fake one on a real 127.0.0.1 socket; each replica is its own
process (``support.serve_process``). Waits are for events (the node's, a
line of a replica's log), each bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import h11
import trio
from conftest import RedisServer
from support import serve_process

from trio_failover.testing import FakeNode, Fleet, NodeIO, ReceivedRequest, request_tcp

LIMIT = 40.0
SLACK = 1.5  # how late things happen on a busy two-core machine with three processes
TTL = 2.0
STREAM = b'{"model": "m", "stream": true}'


@attrs.define
class HeldNode:
    """Holds each request until its client leaves or the test lets it go; counts them."""

    now: int = 0
    most: int = 0
    started: list[float] = attrs.Factory(list)
    release: trio.Event = attrs.Factory(trio.Event)
    changed: trio.Event = attrs.Factory(trio.Event)

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self.changed.wait()

    def _told(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def behaviour(self) -> Callable[[NodeIO, ReceivedRequest], Any]:
        async def behave(io: NodeIO, request: ReceivedRequest) -> None:
            self.now += 1
            self.most = max(self.most, self.now)
            self.started.append(trio.current_time())
            self._told()
            try:
                async with trio.open_nursery() as nursery:

                    async def left() -> None:
                        await io.wait_closed()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(left)
                    await self.release.wait()
                    body = b'{"ok": true}'
                    head = [(b"content-length", b"%d" % len(body))]
                    await io.send(h11.Response(status_code=200, headers=head))
                    await io.send(h11.Data(data=body), h11.EndOfMessage())
                    nursery.cancel_scope.cancel()
            finally:
                self.now -= 1
                self._told()

        return behave


async def test_kill_9_of_a_replica_holding_a_slot_frees_it_within_one_lease_ttl(
    redis_server: RedisServer,
) -> None:
    held = HeldNode()
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
                    held.release.set()
                assert answers == [200]
                assert held.most == 1  # never two at once: B waited for the lease
                # B waited for A's lease to lapse, and no longer than one TTL.
                assert took > TTL / 4
                assert took < TTL + SLACK
