"""The test kit's held requests and direct node requests when their client leaves.

A fake node whose client went away ends that connection, as a real engine
does: it never crashes the fleet it runs in, and a client that leaves gets
its answer (None) as soon as it has left.
"""

from __future__ import annotations

import trio

import trio_failover as tf
from trio_failover.testing import FakeNode, Fleet, HeldRequests, request, request_node

LIMIT = 100.0  # virtual seconds any test here may take


async def test_held_answer_to_a_client_gone_ends_the_connection_quietly(
    autojump_clock: trio.abc.Clock,
) -> None:
    held = HeldRequests()
    with trio.fail_after(LIMIT):
        async with Fleet({"h": FakeNode(held.behaviour())}) as fleet:
            config = tf.Config(upstreams=fleet.upstreams(), admin_listen=None)
            proxy = tf.Proxy(config, connector=fleet.connector)
            assert await request(proxy, body=b"{}", leave_after=1.0) is None
            await held.wait_for(lambda: held.now == 1)
            await trio.sleep(1)  # the proxy has closed the node's connection
            held.let_go()
            # Stay a while: the fleet must outlive the failed answer, not
            # cancel it on its way out.
            await trio.sleep(1)
            assert held.now == 0
            assert fleet["h"].closed_at
        # Leaving the fleet's block raised nothing: the answer's failed send
        # ended only that connection.
    assert held.most == 1
    assert len(held.ended) == 1


async def test_request_node_returns_none_once_its_client_left(
    autojump_clock: trio.abc.Clock,
) -> None:
    held = HeldRequests()
    with trio.fail_after(LIMIT):
        async with Fleet({"h": FakeNode(held.behaviour())}) as fleet:
            start = trio.current_time()
            left = await request_node(fleet["h"], "POST", "/x", body=b"{}", leave_after=1.0)
            assert left is None
            assert trio.current_time() - start == 1.0
            held.let_go()
            await trio.sleep(1)
    assert held.now == 0
    assert held.started == [start]
