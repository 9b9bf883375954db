"""The proxy owns its life: ``open_proxy`` / ``async with Proxy`` / ``Proxy.run``
run its own tasks (ticker, pool watch, silence watch, discovery) without
``serve()``, and close its pooled connections at the end."""

from __future__ import annotations

import functools

import h11
import pytest
import trio
import trio.testing

import trio_failover
from trio_failover import Config, Proxy
from trio_failover.testing import (
    FakeNode,
    Fleet,
    _exchange_in_memory,
    _request_events,
    healthy,
    openai,
    request,
    start_in_fleet,
    stream_then_silence,
)

LIMIT = 3600.0  # virtual seconds: every test ends long before
STREAMED = b'{"model": "m", "stream": true}'


def config_for(fleet: Fleet, **settings: object) -> Config:
    settings.setdefault("discovery_interval", 0)  # the nodes see only the test's requests
    return Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)  # type: ignore[arg-type]


async def test_an_open_proxy_notices_an_expired_cooldown_without_serve(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        config = config_for(fleet)
        async with trio_failover.open_proxy(config, connector=fleet.connector) as proxy:
            proxy.board.demote("a", 4.5, "manual", trio.current_time())
            with proxy.events.subscribe(0) as events, trio.fail_after(LIMIT):
                async for event in events:  # no request, no serve(): only its ticker
                    if event["type"] == "node" and event["state"] == "ready":
                        break
            assert trio.current_time() == 5.0  # the first whole tick after the cooldown
            assert (event["node"], event["reason"]) == ("a", "expired")


async def test_a_stream_times_out_in_an_open_proxy_without_serve(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"quiet": FakeNode(stream_then_silence(2, 600))}) as fleet:
        config = config_for(fleet, stream_idle_timeout=30.0)
        async with Proxy(config, connector=fleet.connector) as proxy:
            assert proxy.running
            with trio.fail_after(LIMIT):
                response = await request(proxy, body=STREAMED)
    assert response is not None
    assert not response.complete
    assert response.at == 30.0  # commit at 0, then thirty seconds of silence


async def test_leaving_the_block_closes_pooled_connections(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        config = config_for(fleet, pool_idle_timeout=100.0)
        async with trio_failover.open_proxy(config, connector=fleet.connector) as proxy:
            response = await request(proxy, body=b"{}")
            assert response is not None
            await trio.testing.wait_all_tasks_blocked()
            assert proxy.pool.idle_count("a") == 1
            assert fleet["a"].closed_at == []
            await trio.sleep(2.0)
        assert not proxy.running
        assert proxy.pool.idle_count("a") == 0
        await trio.testing.wait_all_tasks_blocked()
        assert fleet["a"].closed_at == [2.0]  # at the exit, not at the idle timeout


async def test_an_open_proxy_runs_discovery(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(openai("qwen3"))}) as fleet:
        config = config_for(fleet, discovery_interval=30.0)
        async with trio_failover.open_proxy(config, connector=fleet.connector) as proxy:
            assert proxy.status()["nodes"][0]["models"] is None
            await trio.sleep(1.0)
            assert proxy.status()["nodes"][0]["models"] == ["qwen3"]
    assert [r.target for r in fleet["a"].received][:1] == [b"/health"]


async def test_nursery_start_gives_the_running_proxy_until_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy(b"hi"))}) as fleet:
        proxy = Proxy(config_for(fleet), connector=fleet.connector)
        async with trio.open_nursery() as nursery:
            started = await nursery.start(proxy.run)
            assert started is proxy
            assert proxy.running
            assert proxy.silence.running
            with pytest.raises(RuntimeError, match="runs already"):
                await nursery.start(proxy.run)
            response = await request(proxy, body=b"{}")
            assert response is not None
            assert response.body == b"hi"
            nursery.cancel_scope.cancel()
        assert not proxy.running
        assert not proxy.silence.running
        assert proxy.pool.idle_count("a") == 0


async def test_a_proxy_nobody_runs_serves_with_its_tasks_lent_while_connections_last(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``Proxy(config, connector=...)`` serves a stream handed to it, tasks and all."""
    behave = {"a": FakeNode(stream_then_silence(chunks=1, silence=1000.0))}
    async with Fleet(behave) as fleet:
        proxy = Proxy(config_for(fleet, stream_idle_timeout=30.0), connector=fleet.connector)
        served = functools.partial(_exchange_in_memory, proxy.handle_connection)
        ended: dict[str, float] = {}

        async def one(name: str, events: list[h11.Event]) -> None:
            await served(events, None)
            ended[name] = trio.current_time()

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    one,
                    "first",
                    _request_events("POST", "/v1/chat/completions", b"t", [], STREAMED),
                )
                await trio.sleep(10.0)
                assert proxy.running  # lent to the first connection
                nursery.start_soon(
                    one,
                    "second",
                    _request_events("POST", "/v1/chat/completions", b"t", [], STREAMED),
                )
    # The silence watch ran (each stream cut at its idle timeout, 30 s
    # after it began), also for the second stream after the first one had
    # ended; the first connection's task ran the tasks until then.
    assert [work["duration_ms"] for work in proxy.recent] == [30000.0, 30000.0]
    assert ended == {"first": 40.0, "second": 40.0}
    assert not proxy.running
    assert proxy.pool.idle_count("a") == 0


async def test_the_kit_starts_a_proxy_only_in_a_fleet() -> None:
    proxy = Proxy(Config(upstreams=[trio_failover.Upstream("a", "http://127.0.0.1:9")]))
    with pytest.raises(RuntimeError, match="no fleet"):
        await start_in_fleet(proxy)
    assert not proxy.running


async def test_an_error_in_the_block_leaves_it_unwrapped(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        config = config_for(fleet)
        with pytest.raises(KeyError, match="mine"):
            async with trio_failover.open_proxy(config, connector=fleet.connector) as proxy:
                raise KeyError("mine")
        assert not proxy.running


async def test_the_test_kit_starts_a_proxy_in_its_fleet_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy(b"hi"))}) as fleet:
        proxy = Proxy(config_for(fleet, discovery_interval=30.0), connector=fleet.connector)
        async with trio.open_nursery() as nursery:
            for _ in range(3):  # at once: one starts it, the others wait
                nursery.start_soon(functools.partial(request, proxy, body=b"{}"))
        assert proxy.running
        assert await start_in_fleet(proxy) is proxy
        await trio.sleep(60.0)  # two discovery intervals: the kit runs no checks
        assert [r.target for r in fleet["a"].received] == [b"/v1/chat/completions"] * 3
    assert not proxy.running  # it ended with the fleet's block


async def test_an_open_proxy_closes_an_expired_idle_connection_without_traffic(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        config = config_for(fleet, pool_idle_timeout=3.0)
        async with trio_failover.open_proxy(config, connector=fleet.connector) as proxy:
            response = await request(proxy, body=b"{}")
            assert response is not None
            await trio.sleep(10.0)  # no request: only its pool's watcher can close it
            assert fleet["a"].closed_at == [3.0]
            assert proxy.pool.idle_count("a") == 0
