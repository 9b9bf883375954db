"""Sharing a fleet across replicas over one real redis-server (two ``Proxy`` objects).

The nodes are fake ones over in-memory streams, the shared state is real
(127.0.0.1 sockets, the real clock: no autojump); every wait is bounded by
``trio.fail_after``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio
from conftest import RedisServer
from test_replicas import LIMIT, STREAM, replicas_at, until_connected
from test_sharing import answers_carry_tokens

from trio_failover.core.client_key import ClientKey
from trio_failover.proxy.proxy import Proxy
from trio_failover.testing import FakeNode, healthy, request
from trio_failover.testing.fakes import NodeIO, ReceivedRequest


async def ask(proxy: Proxy, client: str) -> tuple[int, str | None]:
    response = await request(proxy, body=STREAM, headers=[("x-client", client)])
    assert response is not None
    return response.status, response.header("retry-after")


@asynccontextmanager
async def two_replicas(
    redis_server: RedisServer, *clients: ClientKey
) -> AsyncIterator[tuple[Proxy, Proxy]]:
    """Two replicas joined over ``redis_server``, clients named by ``X-Client``."""
    async with replicas_at(
        redis_server.address,
        FakeNode(healthy(b"hi")),
        0,
        2,
        client_header="X-Client",
        clients=clients,
    ) as (a, b):
        for proxy in (a, b):
            assert proxy.fleet is not None
            while not proxy.fleet.state.connected:
                await proxy.fleet.state.wait_changed()
        yield a, b


async def refused_by_both(a: Proxy, b: Proxy, client: str) -> None:
    for proxy in (a, b):
        status, retry_after = await ask(proxy, client)
        assert status == 429
        assert retry_after is not None
        assert 1 <= int(retry_after) <= 60


async def test_rpm_holds_across_two_replicas(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with two_replicas(redis_server, ClientKey("r", rpm=3)) as (a, b):
            answers = [await ask(proxy, "r") for proxy in (a, b, a)]
            assert answers == [(200, None)] * 3
            await refused_by_both(a, b, "r")  # the fourth of the minute, wherever it goes
            assert await ask(b, "other") == (200, None)  # only r's minute is full


async def test_tpm_holds_across_two_replicas(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with two_replicas(redis_server, ClientKey("t", tpm=100)) as (a, b):
            for proxy in (a, b):
                answers_carry_tokens(proxy, 40, 20)
            assert await ask(a, "t") == (200, None)  # 60 tokens
            assert await ask(b, "t") == (200, None)  # 60 held, below 100: 120 now
            await refused_by_both(a, b, "t")


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (bounded: 500 looks, 10 ms apart) until it holds."""
    for _ in range(500):
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError("the condition never held")


async def test_a_freed_slot_goes_to_the_fleets_fairest_client(redis_server: RedisServer) -> None:
    """One client floods replica a; another asks through b: the next freed slot is b's client's."""
    started: list[str] = []  # each request's client, as the node began it
    gates: list[trio.Event] = []
    answer = healthy(b"hi")
    opened = trio.Event()

    async def gated(io: NodeIO, received: ReceivedRequest) -> None:
        gate = trio.Event()
        started.append((received.header("x-client") or b"?").decode())
        gates.append(gate)
        if not opened.is_set():
            await gate.wait()
        await answer(io, received)

    with trio.fail_after(LIMIT):
        async with (
            replicas_at(redis_server.address, FakeNode(gated), 2, 2, client_header="X-Client") as (
                a,
                b,
            ),
            trio.open_nursery() as nursery,
        ):
            for proxy in (a, b):
                await until_connected(proxy, True)
            for _ in range(6):
                nursery.start_soon(ask, a, "flood")
            await until(lambda: len(started) == 2 and len(a.queue) == 4)
            nursery.start_soon(ask, b, "chat")
            assert a.fleet is not None
            fair = a.fleet.fair
            await until(
                lambda: (
                    len(b.queue) == 1
                    and any(
                        share.client == "chat" and share.waiting
                        for summary in fair.fresh(trio.current_time())
                        for share in summary.clients
                    )
                )
            )
            gates[0].set()  # one of the flood's slots frees at a
            await until(lambda: len(started) == 3)
            assert started[2] == "chat"  # not a's own waiter, first in its queue
            assert fair.deferred == 1
            opened.set()  # the rest run through, whichever replica they wait at
            for gate in gates:
                gate.set()


async def test_max_in_flight_holds_across_two_replicas(redis_server: RedisServer) -> None:
    """A client of ``max_in_flight = 1`` running through a waits at b, on a node with room."""
    started: list[str] = []
    gate = trio.Event()
    answer = healthy(b"hi")

    async def gated(io: NodeIO, received: ReceivedRequest) -> None:
        started.append((received.header("x-client") or b"?").decode())
        await gate.wait()
        await answer(io, received)

    with trio.fail_after(LIMIT):
        async with (
            replicas_at(
                redis_server.address,
                FakeNode(gated),
                2,
                2,
                client_header="X-Client",
                clients=[ClientKey("one", max_in_flight=1)],
            ) as (a, b),
            trio.open_nursery() as nursery,
        ):
            for proxy in (a, b):
                await until_connected(proxy, True)
            nursery.start_soon(ask, a, "one")
            await until(lambda: started == ["one"])
            assert b.fleet is not None
            shares = b.queue.scheduler.shares
            await until(lambda: "one" in shares.clients and shares.clients["one"].elsewhere == 1)
            nursery.start_soon(ask, b, "one")
            await until(lambda: len(b.queue) == 1)  # waits at b, though the node has room
            assert started == ["one"]
            gate.set()  # a's attempt ends: a tells it, and b's waiter runs
            await until(lambda: started == ["one", "one"])
