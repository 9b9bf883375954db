"""``GET /usage`` across replicas: every replica's counts, added up in one real redis-server.

The layout and its scripts (``core/rate_layout.py``), the client that runs
them (``wire/client_rates.py``), and two ``Proxy`` replicas whose usage is
read back from either one (``fleet/shared_usage.py``); the nodes are fake
ones over in-memory streams, the clock real, every wait bounded.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from conftest import RedisServer
from test_replicas import LIMIT, replicas_at, until_connected

from trio_failover.core import rate_layout
from trio_failover.core.usage_book import Counts
from trio_failover.proxy.proxy import Proxy
from trio_failover.testing import FakeNode, healthy, request
from trio_failover.wire.client_rates import ClientRates
from trio_failover.wire.redis import open_redis

ANSWER = json.dumps(
    {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }
).encode()


def body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


async def ask(proxy: Proxy, client: str, model: str = "m") -> None:
    response = await request(proxy, body=body(model), headers=[("x-client", client)])
    assert response is not None
    assert response.status == 200


def entries(document: dict[str, Any]) -> dict[tuple[str, str | None], tuple[int, int, int]]:
    return {
        (entry["client"], entry["model"]): (
            entry["requests"],
            entry["prompt_tokens"],
            entry["completion_tokens"],
        )
        for entry in document["clients"]
    }


async def until_usage(
    proxy: Proxy, want: dict[tuple[str, str | None], tuple[int, int, int]]
) -> dict[str, Any]:
    """Read ``proxy``'s ``GET /usage`` until it shows ``want`` (bounded: 500 reads, 20 ms apart)."""
    document: dict[str, Any] = {}
    for _ in range(500):
        document = await proxy.usage()
        if entries(document) == want:
            return document
        await trio.sleep(0.02)
    raise AssertionError(f"usage never became {want}: {document}")


# -- the layout, table-tested ----------------------------------------------------------


def test_a_batch_is_a_field_and_a_model_per_pair_and_its_counts() -> None:
    batch = {
        ("ann", "m:latest"): ("m", Counts(2, 14, 6, 1, 1.2345)),
        ("bob", None): (None, Counts(1, 0, 0, 0, 0.0)),
    }
    assert rate_layout.usage_args("p:", batch) == [
        "p:usage:minute:",
        *("ann\x1fm:latest", "m", 2, 14, 6, 1, 1234),
        *("bob\x1f\x00", "\x00", 1, 0, 0, 0, 0),
    ]


def test_the_read_reply_gives_each_pair_its_model_total_and_last_hour() -> None:
    totals = [b"ann\x1fm:latest\x1erequests", b"3", b"ann\x1fm:latest\x1eslot_ms", b"1500"]
    names = [b"ann\x1fm:latest", b"M"]
    minute = [b"ann\x1fm:latest\x1erequests", b"1", b"bob\x1f\x00\x1erequests", b"2"]
    found = rate_layout.read_usage([totals, names, [], minute])
    assert set(found) == {("ann", "m:latest"), ("bob", None)}
    shown, total, hour = found["ann", "m:latest"]
    assert (shown, total.requests, total.slot_seconds, hour.requests) == ("M", 3, 1.5, 1)
    shown, total, hour = found["bob", None]  # only in the last hour: a total from elsewhere
    assert (shown, total.requests, hour.requests) == (None, 0, 2)


@pytest.mark.parametrize("reply", [None, [b"x"], [[b"odd"], []], [[], [], 5]])
def test_a_read_reply_of_another_shape_is_refused(reply: object) -> None:
    with pytest.raises(ValueError, match="unexpected"):
        rate_layout.read_usage(reply)


# -- the scripts on a real redis-server --------------------------------------------------


async def with_rates(
    redis_server: RedisServer, body: Callable[[ClientRates], Awaitable[None]]
) -> None:
    with trio.fail_after(LIMIT):
        deadline = trio.current_time() + LIMIT
        async with await open_redis(redis_server.address, deadline=deadline) as redis:
            await body(ClientRates(redis, "t:"))


async def test_a_batch_sent_twice_counts_once_and_in_the_last_hour(
    redis_server: RedisServer,
) -> None:
    async def check(rates: ClientRates) -> None:
        soon = trio.current_time() + LIMIT
        batch = {("ann", "m:latest"): ("m", Counts(1, 7, 3, 0, 0.25))}
        await rates.add_usage("one", batch, deadline=soon)
        await rates.add_usage("one", batch, deadline=soon)  # its answer was lost: sent again
        await rates.add_usage("two", batch, deadline=soon)
        [(pair, (shown, total, hour))] = (await rates.read_usage(deadline=soon)).items()
        assert (pair, shown) == (("ann", "m:latest"), "m")
        assert total == hour == Counts(2, 14, 6, 0, 0.5)

    await with_rates(redis_server, check)


# -- two replicas -----------------------------------------------------------------------


@asynccontextmanager
async def two_replicas(redis_server: RedisServer) -> AsyncIterator[tuple[Proxy, Proxy]]:
    """Two replicas joined over ``redis_server``, clients named by ``X-Client``."""
    async with replicas_at(
        redis_server.address, FakeNode(healthy(ANSWER)), 0, 2, client_header="X-Client"
    ) as (a, b):
        for proxy in (a, b):
            await until_connected(proxy, True)
        yield a, b


async def test_usage_at_either_replica_is_the_fleets(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with two_replicas(redis_server) as (a, b):
            await ask(a, "ann")
            # Shown as first written to Redis: "m" once it is there.
            await until_usage(b, {("ann", "m"): (1, 7, 3)})
            await ask(b, "ann", "m:latest")  # one model with "m"
            await ask(b, "bob")
            want = {("ann", "m"): (2, 14, 6), ("bob", "m"): (1, 7, 3)}
            for proxy in (a, b):
                document = await until_usage(proxy, want)
                [ann, _] = document["clients"]
                assert ann["last_hour"]["requests"] == 2
                assert ann["slot_seconds"] == ann["last_hour"]["slot_seconds"] >= 0
            # Each replica's own book counts only what it served.
            assert entries(a.report.usage.document(trio.current_time())) == {
                ("ann", "m"): (1, 7, 3)
            }


async def test_while_redis_is_away_a_replica_shows_its_own_and_tells_it_later(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(LIMIT):
        async with two_replicas(redis_server) as (a, b):
            await ask(b, "bob")
            await until_usage(a, {("bob", "m"): (1, 7, 3)})
            redis_server.stop()
            await until_connected(a, False)
            await ask(a, "ann")
            assert entries(await a.usage()) == {("ann", "m"): (1, 7, 3)}  # its own only
            redis_server.start()  # empty: a restarted Redis kept nothing
            await until_connected(a, True)
            await until_usage(b, {("ann", "m"): (1, 7, 3)})  # told once Redis was back
