"""The series an operator alerts on, through the running proxy: each node's state, the
shared state's link, reloads by result; and the help texts stand alone.

The node and reload tests run over in-memory streams under
``MockClock(autojump_threshold=0)``; the Redis one over a real redis-server
(the real clock: every wait is for the shared state's own news, bounded by
``trio.fail_after``).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import trio
from conftest import RedisServer
from prometheus_client.parser import text_string_to_metric_families
from test_discovery import chat, checking, listing, node_status, routed
from test_reload import make_proxy, nodes
from test_reload_service import NODE_A, make_reloader
from test_replicas import until_connected, until_replicas

from trio_failover import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.telemetry.metrics import Metrics
from trio_failover.testing import FakeNode, Fleet, healthy, request, retry_status, start_in_fleet

LIMIT = 30.0


def scraped(proxy: Proxy) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``/metrics``'s text, as the admin route renders it."""
    text = proxy.metrics.render()[0].decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def states(proxy: Proxy, node: str) -> dict[str, float]:
    """``trio_failover_node_state`` of ``node``, by state."""
    return {
        dict(labels)["state"]: value
        for (name, labels), value in scraped(proxy).items()
        if name == "trio_failover_node_state" and dict(labels)["node"] == node
    }


READY = {"ready": 1.0, "cooling": 0.0, "down": 0.0}
COOLING = {"ready": 0.0, "cooling": 1.0, "down": 0.0}
DOWN = {"ready": 0.0, "cooling": 0.0, "down": 1.0}
GONE = {"ready": 0.0, "cooling": 0.0, "down": 0.0}


async def test_node_state_flips_with_the_down_mark_and_the_cooldown(
    autojump_clock: trio.abc.Clock,
) -> None:
    a = FakeNode(listing("m"), refuse=True)
    checks = {b"/health": healthy(), b"/v1/models": listing("m")}
    busy = retry_status(429, headers=[("retry-after", "5")])  # cools b for 5 s
    b = FakeNode(routed(checks, default=busy))  # passes its checks, 429s a chat
    async with Fleet({"a": a, "b": b}) as fleet, checking(fleet, interval=10.0) as proxy:
        assert states(proxy, "b") == READY
        await trio.sleep(0.9)  # a's first check (at 0) could not connect; b's (at 0.5) passed
        assert node_status(proxy, "a")["state"] == "down"
        assert states(proxy, "a") == DOWN
        assert scraped(proxy)[("trio_failover_down_nodes", frozenset())] == 1
        # Down is the graver news, as in /status: a cooldown too changes nothing shown.
        proxy.board.demote("a", 15.0, "test", trio.current_time())  # to 15.9
        assert node_status(proxy, "a")["state"] == "down"
        assert states(proxy, "a") == DOWN

        response = await request(proxy, body=chat())  # b answers 429: cooled down to 5.9
        assert response is not None
        assert node_status(proxy, "b")["state"] == "cooling"
        assert states(proxy, "b") == COOLING

        a.refuse = False  # up at its next check, at 10.0: cooling still, to 15.9
        await trio.sleep(10.1 - trio.current_time())
        assert node_status(proxy, "a")["state"] == "cooling"
        assert states(proxy, "a") == COOLING
        # The ticker noticed b's cooldown end (at 5.9) within its second.
        assert node_status(proxy, "b")["state"] == "ready"
        assert states(proxy, "b") == READY
        await trio.sleep(17.0 - trio.current_time())
        assert states(proxy, "a") == READY
        assert scraped(proxy)[("trio_failover_down_nodes", frozenset())] == 0
        assert scraped(proxy)[("trio_failover_cooling_nodes", frozenset())] == 0


async def test_reloads_count_by_result_and_node_states_follow_the_node_list(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy()), "c": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, capacity=2)
        reloads = ("trio_failover_reloads_total", "result")
        assert scraped(proxy)[(reloads[0], frozenset({(reloads[1], "failed")}))] == 0
        refused = attrs.evolve(proxy.config, listen="127.0.0.1:9")
        assert not (await proxy.reload(refused)).ok
        found = scraped(proxy)
        assert found[(reloads[0], frozenset({(reloads[1], "failed")}))] == 1
        assert found[(reloads[0], frozenset({(reloads[1], "ok")}))] == 0

        proxy.board.demote("a", 60.0, "test", trio.current_time())
        assert (await proxy.reload(attrs.evolve(proxy.config, upstreams=nodes(fleet, "c")))).ok
        found = scraped(proxy)
        assert found[(reloads[0], frozenset({(reloads[1], "ok")}))] == 1
        assert states(proxy, "a") == GONE  # removed: in none of the states
        assert states(proxy, "c") == READY
        assert found[("trio_failover_cooling_nodes", frozenset())] == 0


async def test_a_reload_of_a_file_that_does_not_read_counts_as_failed(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(NODE_A.format(a="http://127.0.0.1:9001"))
    reloader = make_reloader(path)
    path.write_text(NODE_A.format(a="http://127.0.0.1:9001") + 'capacity = "2"\n')
    assert not (await reloader.reload()).ok
    assert not (await reloader.reload(dry_run=True)).ok  # a dry run is no reload
    found = scraped(reloader.proxy)
    assert found[("trio_failover_reloads_total", frozenset({("result", "failed")}))] == 1
    assert found[("trio_failover_reloads_total", frozenset({("result", "ok")}))] == 0


async def test_state_connected_goes_to_0_while_redis_is_away(redis_server: RedisServer) -> None:
    address = redis_server.address
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(healthy())}) as fleet:
            shared = Config(
                upstreams=fleet.upstreams(),
                admin_listen=None,
                state=f"redis://{address.host}:{address.port}",
                lease_ttl=3.0,  # a heartbeat each second
            )
            one = await start_in_fleet(Proxy(shared, connector=fleet.connector))
            await start_in_fleet(Proxy(shared, connector=fleet.connector))  # a second replica
            await until_connected(one, True)
            await until_replicas(one, 2)
            connected = ("trio_failover_state_connected", frozenset())
            replicas = ("trio_failover_state_replicas", frozenset())
            assert (scraped(one)[connected], scraped(one)[replicas]) == (1, 2)
            redis_server.stop()
            await until_connected(one, False)
            assert (scraped(one)[connected], scraped(one)[replicas]) == (0, 2)  # as last seen
            redis_server.start()
            await until_connected(one, True)
            assert scraped(one)[connected] == 1


def test_a_proxy_without_shared_state_is_connected_alone() -> None:
    proxy = Proxy(Config(upstreams=[Upstream("a", "http://127.0.0.1:9")], admin_listen=None))
    found = scraped(proxy)
    assert found[("trio_failover_state_connected", frozenset())] == 1
    assert found[("trio_failover_state_replicas", frozenset())] == 1


def test_help_texts_say_the_rule_not_where_it_is_written() -> None:
    for family in Metrics(["a"]).registry.collect():
        assert "SPEC" not in family.documentation, family.name
