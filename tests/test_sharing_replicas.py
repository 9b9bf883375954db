"""Sharing a fleet across replicas over one real redis-server (two ``Proxy`` objects).

The nodes are fake ones over in-memory streams, the shared state is real
(127.0.0.1 sockets, the real clock: no autojump); every wait is bounded by
``trio.fail_after``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from conftest import RedisServer
from test_replicas import LIMIT, STREAM, replicas_at
from test_sharing import answers_carry_tokens

from trio_failover.core.client_key import ClientKey
from trio_failover.proxy.proxy import Proxy
from trio_failover.testing import FakeNode, healthy, request


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
