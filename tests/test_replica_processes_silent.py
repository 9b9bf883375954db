"""Real replica processes over a redis-server that stops answering: no request waits.

``SIGSTOP`` freezes the server: the kernel still accepts connections and
takes the replicas' writes, nothing answers. Each request then waits at
most ``--state-timeout`` for its slot's take and goes on alone; once the
server goes on (``SIGCONT``) the replicas join again, and the late takes'
leases are released (the releases Redis may not have heard go out first).
"""

from __future__ import annotations

import signal

import trio
from conftest import RedisServer
from test_replica_processes import LIMIT, SLACK, STREAM, joined, state_options

from trio_failover.testing import FakeNode, Fleet, healthy, request_tcp

STATE_TIMEOUT = 0.25


async def test_a_redis_that_answers_nothing_delays_no_request_past_the_state_timeout(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(healthy(b"hi"))}
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet:
            node = await fleet.serve_tcp("gpu-1")
            more = (
                f"--upstream=gpu-1={node.url}",
                "--capacity=1",  # every request takes its lease: a round trip
                f"--state-timeout={STATE_TIMEOUT * 1000:g}ms",
                "--lease-ttl=30s",
            )
            async with joined(*state_options(redis_server, *more)) as (a, b):
                process = redis_server.process
                assert process is not None
                process.send_signal(signal.SIGSTOP)
                try:
                    for _ in range(3):
                        for replica in (a, b):
                            start = trio.current_time()
                            response = await request_tcp(replica.address, body=STREAM)
                            took = trio.current_time() - start
                            assert response is not None
                            assert response.status == 200
                            assert took < STATE_TIMEOUT + SLACK, took
                    for replica in (a, b):  # the probe after a late take timed out too
                        with trio.fail_after(10):
                            await replica.lines.wait_for("shared state unreachable")
                finally:
                    process.send_signal(signal.SIGCONT)
                # Redis answers again. At the rejoin each replica sends the releases
                # Redis may not have heard, before any take on the connection, so
                # nothing the late takes left keeps a request at the node of one
                # slot waiting.
                for replica in (a, b):
                    with trio.fail_after(15):
                        await replica.lines.wait_for("shared state: rejoined")
                for replica in (a, b):
                    start = trio.current_time()
                    response = await request_tcp(replica.address, body=STREAM)
                    assert response is not None
                    assert response.status == 200
                    assert trio.current_time() - start < SLACK
                assert len(nodes["gpu-1"].received) == 8
