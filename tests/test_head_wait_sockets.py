"""The head wait over real loopback sockets: a pooled connection closed late, a short
unstreamed timeout.

Black-box: the proxy (``serve``) and fake nodes (``Fleet.serve_tcp``) on
127.0.0.1, real clock. Each node's delays are its behaviour, not a test's
synchronisation: the assertions are about what each node received and
which node answered, not about how fast this machine is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from trio_failover import Config, Upstream
from trio_failover.service.server import serve
from trio_failover.testing import FakeNode, Fleet, NodeIO, ReceivedRequest, healthy, request_tcp

LIMIT = 30.0  # real seconds: a bound, never reached on a working proxy
UNSTREAMED = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@asynccontextmanager
async def proxy_over(
    nodes: dict[str, FakeNode], **settings: object
) -> AsyncIterator[tuple[Fleet, tuple[str, int]]]:
    async with Fleet(nodes) as fleet:
        upstreams: list[Upstream] = [await fleet.serve_tcp(name) for name in nodes]
        config = Config(
            upstreams=upstreams,
            listen="127.0.0.1:0",
            admin_listen=None,
            discovery_interval=0,  # the nodes count what they receive
            **settings,  # type: ignore[arg-type]
        )
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(functools.partial(serve, config))
            yield fleet, addresses.client
            nursery.cancel_scope.cancel()


def holds_the_second_request_then_closes(hold: float) -> object:
    """Answers a connection's first request; holds the second ``hold`` s, then closes silently.

    A node that took the request (a prefill began), then went away: it had
    the request, and must never be sent it again.
    """
    seen: set[int] = set()

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if id(io) not in seen:
            seen.add(id(io))
            await healthy(b"first")(io, request)
            return
        await trio.sleep(hold)
        await io.stream.aclose()

    return behave


async def test_a_pooled_request_the_node_held_then_dropped_is_never_sent_twice() -> None:
    node = FakeNode(holds_the_second_request_then_closes(0.6))  # type: ignore[arg-type]
    nodes = {"a": node, "b": FakeNode(healthy(b"from b"))}
    with trio.fail_after(LIMIT):
        async with proxy_over(nodes, pool_idle_timeout=30.0) as (fleet, address):
            first = await request_tcp(address, body=UNSTREAMED)
            assert first is not None
            assert first.body == b"first"
            second = await request_tcp(address, body=UNSTREAMED)  # a's pooled connection
            assert second is not None
            assert (second.status, second.body) == (200, b"from b")
            assert second.header("x-failover-attempts") == "2"
            posts = [r for r in fleet["a"].received if r.method == b"POST"]
            assert len(posts) == 2  # the first and the second, each once
            assert fleet["a"].connections == 1  # no fresh connection for a resend


async def test_an_unstreamed_timeout_below_the_header_timeout_is_the_deadline() -> None:
    """--unstreamed-timeout 1s with --response-header-timeout 5s: the wait ends at 1 s."""
    nodes = {
        "a": FakeNode(healthy(b"from a", head_delay=2.5)),  # would answer at 2.5 s
        "b": FakeNode(healthy(b"from b")),
    }
    with trio.fail_after(LIMIT):
        async with proxy_over(
            nodes, response_header_timeout=5.0, unstreamed_timeout=1.0, liveness_interval=0
        ) as (fleet, address):
            started = trio.current_time()
            response = await request_tcp(address, body=UNSTREAMED)
            took = trio.current_time() - started
            assert response is not None
            assert (response.status, response.body) == (200, b"from b")
            assert response.header("x-failover-attempts") == "2"
            assert took >= 1.0  # the deadline, not earlier
            assert len(fleet["b"].received) == 1
