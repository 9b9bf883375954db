"""A reload of the running proxy, in virtual time (issue 32).

The proxy runs over in-memory streams with fake nodes under
``MockClock(autojump_threshold=0)``; ``Proxy.reload`` gets a new ``Config``
while workloads run and wait. The fleet's connector knows every fake node,
configured or not, so a reload can add one.
"""

from __future__ import annotations

import functools
import json
from typing import Any
from urllib.parse import urlsplit

import attrs
import pytest
import trio
from test_queue import BODY, Traffic, by_request, ids, in_flight, make_proxy, run_traffic

from trio_failover import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    FakeLlamaServer,
    FakeNode,
    Fleet,
    MemoryConnector,
    NodeIO,
    ReceivedRequest,
    frozen,
    healthy,
    openai,
    request,
    retry_status,
    slow_head,
    start_in_fleet,
)


def nodes(fleet: Fleet, *names: str, **capacity: int) -> list[Upstream]:
    return [
        attrs.evolve(u, capacity=capacity.get(u.name, 0))
        for u in fleet.upstreams()
        if u.name in names
    ]


def reload_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == "reload"]


async def test_a_reload_in_the_middle_of_100_streams_loses_none(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Every stream ends whole at the node it began on; the next requests use the new list."""
    fleet_nodes = {name: FakeNode(openai(tokens=20, token_delay=1.0)) for name in "abc"}
    async with Fleet(fleet_nodes) as fleet:
        config = Config(upstreams=nodes(fleet, "a", "b"), admin_listen=None, balance="least-loaded")
        proxy = Proxy(config, connector=fleet.connector)
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            headers = [("x-request-id", f"r{i}")]
            results[i] = await request(proxy, body=BODY, headers=headers)

        with trio.fail_after(1000):
            async with trio.open_nursery() as nursery:
                for i in range(100):
                    nursery.start_soon(one, i)
                await trio.sleep(5.0)  # all streaming, a quarter through
                assert sum(in_flight(proxy).values()) == 100
                new = attrs.evolve(config, upstreams=nodes(fleet, "a", "c"))
                result = await proxy.reload(new)
                assert result.ok, result
                assert result.changes == ("node c added", "node b removed")
                nursery.start_soon(one, 100)  # while a still streams 50: to the new node
        assert len(results) == 101
        assert {r.status for r in results.values()} == {200}
        assert all(r.body.endswith(b"data: [DONE]\n\n") for r in results.values())
        assert all(r.body.count(b"word") == 20 for r in results.values())
        assert len(fleet["b"].received) == 50  # its half, all of it served there
        assert ids(fleet["c"]) == ["r100"]  # least loaded: the new node
        assert [n["name"] for n in proxy.status()["nodes"]] == ["a", "c"]


async def test_a_lowered_capacity_lets_no_new_attempt_in_until_under_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    behave = by_request(slow_head(1.0), r1=slow_head(10.0), r2=slow_head(20.0), r3=slow_head(30.0))
    async with Fleet({"a": FakeNode(behave)}) as fleet:
        proxy = make_proxy(fleet, capacity=4)

        async def script(t: Traffic) -> None:
            for rid in ("r1", "r2", "r3"):
                await t.start(rid)
            lowered = attrs.evolve(proxy.config, upstreams=nodes(fleet, "a", a=1))
            result = await proxy.reload(lowered)
            assert result.changes == ("node a: capacity changed",)
            queued = await t.start("r4", "queued")
            assert queued["position"] == 1
            running = await t.wait_for("r4", "running")
            assert running["node"] == "a"
            assert trio.current_time() == 30.0  # not at 10 or 20: 2 and 1 were not under 1

        traffic = await run_traffic(proxy, script)
        assert traffic.responses["r4"] is not None
        assert traffic.responses["r4"].at == 31.0
        assert proxy.status()["nodes"][0]["capacity"] == 1
        assert in_flight(proxy) == {"a": 0}


async def test_a_removed_nodes_queued_workloads_go_elsewhere(
    autojump_clock: trio.abc.Clock,
) -> None:
    fleet_nodes = {"a": FakeNode(slow_head(10.0, b"A")), "c": FakeNode(healthy(b"C"))}
    async with Fleet(fleet_nodes) as fleet:
        config = Config(upstreams=nodes(fleet, "a", a=1), admin_listen=None, liveness_interval=0)
        proxy = Proxy(config, connector=fleet.connector)

        async def script(t: Traffic) -> None:
            await t.start("r1")
            await t.start("r2", "queued")
            await t.start("r3", "queued")
            moved = attrs.evolve(proxy.config, upstreams=nodes(fleet, "c"))
            assert (await proxy.reload(moved)).ok
            assert (await t.wait_for("r2", "running"))["node"] == "c"
            assert (await t.wait_for("r3", "running"))["node"] == "c"
            assert trio.current_time() == 0.0  # at once, not after r1's 10 s

        traffic = await run_traffic(proxy, script)
        responses = {rid: (r.status, r.body) for rid, r in traffic.responses.items() if r}
        assert responses == {"r1": (200, b"A"), "r2": (200, b"C"), "r3": (200, b"C")}
        assert ids(fleet["a"]) == ["r1"]  # the running one kept its node
        assert sorted(ids(fleet["c"])) == ["r2", "r3"]
        assert in_flight(proxy) == {"c": 0}


async def test_a_queued_workload_that_no_node_serves_after_a_reload_gets_its_answer(
    autojump_clock: trio.abc.Clock,
) -> None:
    fleet_nodes = {"a": FakeNode(slow_head(10.0)), "c": FakeNode(healthy(b"C"))}
    async with Fleet(fleet_nodes) as fleet:
        config = Config(upstreams=nodes(fleet, "a", a=1), admin_listen=None)
        proxy = Proxy(config, connector=fleet.connector)

        async def script(t: Traffic) -> None:
            await t.start("r1")
            await t.start("r2", "queued")
            other = [attrs.evolve(nodes(fleet, "c")[0], models=["other"])]
            assert (await proxy.reload(attrs.evolve(config, upstreams=other))).ok
            await t.wait_for("r2", "failed")
            assert trio.current_time() == 0.0

        traffic = await run_traffic(proxy, script)
        answer = traffic.responses["r2"]
        assert answer is not None
        assert answer.status == 404
        assert json.loads(answer.body)["error"]["code"] == "model_not_found"


async def test_a_listener_change_is_refused_and_changes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy()), "c": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, capacity=2)
        config = proxy.config
        with proxy.events.subscribe(0) as events:
            refused = attrs.evolve(config, listen="127.0.0.1:9", upstreams=nodes(fleet, "c"))
            result = await proxy.reload(refused)
            event = events.receive.receive_nowait()
        assert not result.ok
        assert result.error == "listen: 127.0.0.1:8080 -> 127.0.0.1:9 needs a restart"
        assert event == {"type": "reload", "ok": False, "changes": [], "error": result.error}
        assert proxy.config is config
        assert [n["name"] for n in proxy.status()["nodes"]] == ["a", "c"]
        answer = await request(proxy, body=BODY)
        assert answer is not None
        assert answer.status == 200
        assert len(fleet["a"].received) == 1


async def test_kept_nodes_keep_their_cooldown_and_counters(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy()), "b": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, capacity=0)
        assert (await request(proxy, body=BODY)) is not None
        proxy.board.demote("b", 60.0, "test", trio.current_time())
        with proxy.events.subscribe(0) as events:
            new = attrs.evolve(proxy.config, upstreams=nodes(fleet, "a", "b", a=3))
            result = await proxy.reload(new)
            assert events.receive.receive_nowait()["changes"] == ["node a: capacity changed"]
        assert result.ok
        status = {n["name"]: n for n in proxy.status()["nodes"]}
        assert status["a"]["served"] == 1
        assert status["a"]["capacity"] == 3
        assert status["b"]["state"] == "cooling"


async def test_a_rotated_key_takes_effect_for_the_next_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    from trio_failover import ClientKey

    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        config = Config(
            upstreams=nodes(fleet, "a"), admin_listen=None, clients=[ClientKey("al", "old-key")]
        )
        proxy = Proxy(config, connector=fleet.connector)
        rotated = attrs.evolve(config, clients=[ClientKey("al", "new-key")])
        result = await proxy.reload(rotated)
        assert result.changes == ("client al: key rotated",)
        assert "new-key" not in repr(result)
        assert "old-key" not in repr(result)
        old = await request(proxy, body=BODY, headers=[("authorization", "Bearer old-key")])
        new = await request(proxy, body=BODY, headers=[("authorization", "Bearer new-key")])
        assert old is not None
        assert old.status == 401
        assert new is not None
        assert new.status == 200


async def test_discovery_checks_the_added_nodes_and_stops_checking_the_removed(
    autojump_clock: trio.abc.Clock,
) -> None:
    fleet_nodes = {name: FakeNode(openai()) for name in "ac"}
    async with Fleet(fleet_nodes) as fleet:
        config = Config(upstreams=nodes(fleet, "a"), admin_listen=None, discovery_interval=10.0)
        proxy = Proxy(config, connector=fleet.connector)

        def checks(name: str) -> int:
            return sum(r.target == b"/health" for r in fleet[name].received)

        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.discovery.run)
            await trio.sleep(25)
            assert checks("a") == 3  # at 0, 10, 20 (less a jitter)
            assert (await proxy.reload(attrs.evolve(config, upstreams=nodes(fleet, "c")))).ok
            await trio.sleep(30)
            nursery.cancel_scope.cancel()
        assert checks("a") == 3
        assert checks("c") >= 3  # at once, then each interval
        assert proxy.status()["nodes"][0]["models"] == ["fake-model"]


async def test_the_engine_reader_reads_the_added_nodes_and_the_capacity_follows(
    autojump_clock: trio.abc.Clock,
) -> None:
    engines = {"a": FakeLlamaServer(slots=2), "c": FakeLlamaServer(slots=3)}
    async with Fleet({name: FakeNode(engine) for name, engine in engines.items()}) as fleet:
        upstreams = [attrs.evolve(u, engine="llama-server") for u in fleet.upstreams()]
        config = Config(upstreams=upstreams[:1], admin_listen=None, discovery_interval=0.0)
        proxy = Proxy(config, connector=fleet.connector)
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.engine_reader.run)
            await trio.sleep(1)
            assert (await proxy.reload(attrs.evolve(config, upstreams=upstreams[1:]))).ok
            await trio.sleep(5)
            nursery.cancel_scope.cancel()
        slots = [r.at for r in fleet["a"].received if r.target == b"/slots"]
        assert slots == [0.0]  # removed at 1 s: read no more
        assert [n["capacity"] for n in proxy.status()["nodes"]] == [3]  # c's, auto
        assert proxy.engines.signals.keys() == {"c"}


async def test_a_removed_nodes_idle_connections_close(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(healthy()), "b": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, capacity=0)
        for node in ("a", "b"):
            answer = await request(proxy, body=BODY, headers=[("x-failover-node", node)])
            assert answer is not None
        assert (proxy.pool.idle_count("a"), proxy.pool.idle_count("b")) == (1, 1)
        assert (await proxy.reload(attrs.evolve(proxy.config, upstreams=nodes(fleet, "a")))).ok
        assert (proxy.pool.idle_count("a"), proxy.pool.idle_count("b")) == (1, 0)


async def test_a_stream_at_a_moved_node_does_not_pool_its_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    """After the node's URL changed, the old address's connection is not reused."""
    async with Fleet({"a": FakeNode(slow_head(10.0))}) as fleet:
        proxy = make_proxy(fleet, capacity=0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(request, proxy, body=BODY))
            await trio.sleep(1)
            moved = attrs.evolve(nodes(fleet, "a")[0], url="http://moved.invalid:80")
            assert (await proxy.reload(attrs.evolve(proxy.config, upstreams=[moved]))).ok
        assert proxy.pool.idle_count("a") == 0  # the stream ended after the reload
        answer = await request(proxy, body=BODY)
        assert answer is not None
        assert proxy.pool.idle_count("a") == 1  # a connection of the current definition


async def test_a_stream_at_a_removed_node_does_not_pool_its_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A workload that outlives its node's removal closes its connection at its end.

    Pooled, it would wait under the removed name, and a later reload that
    adds a node of that name at another address would be handed it.
    """
    async with Fleet({"a": FakeNode(healthy()), "b": FakeNode(slow_head(10.0))}) as fleet:
        proxy = make_proxy(fleet, capacity=0)
        async with trio.open_nursery() as nursery:
            pinned = functools.partial(
                request, proxy, body=BODY, headers=[("x-failover-node", "b")]
            )
            nursery.start_soon(pinned)
            await trio.sleep(1)  # b is answering it
            assert (await proxy.reload(attrs.evolve(proxy.config, upstreams=nodes(fleet, "a")))).ok
        await trio.testing.wait_all_tasks_blocked()
        b = fleet["b"]
        assert [r.target for r in b.received] == [b"/v1/chat/completions"]
        assert proxy.pool.idle_count("b") == 0  # the stream ended after the removal
        assert len(b.closed_at) == b.connections  # and its connection is closed


async def test_a_failover_after_a_reload_takes_the_new_list(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def late_503(io: NodeIO, received: ReceivedRequest) -> None:
        await trio.sleep(10)
        await retry_status(503)(io, received)

    fleet_nodes = {
        "a": FakeNode(late_503),
        "b": FakeNode(healthy(b"B")),
        "c": FakeNode(healthy(b"C")),
    }
    async with Fleet(fleet_nodes) as fleet:
        config = Config(upstreams=nodes(fleet, "a", "b"), admin_listen=None)
        proxy = Proxy(config, connector=fleet.connector)
        async with trio.open_nursery() as nursery:
            answers: list[Any] = []

            async def send() -> None:
                answers.append(await request(proxy, body=BODY))

            nursery.start_soon(send)
            await trio.sleep(1)  # at a, which fails at 10 s
            assert (await proxy.reload(attrs.evolve(config, upstreams=nodes(fleet, "a", "c")))).ok
        assert answers[0].body == b"C"
        assert answers[0].at == 10.0
        assert fleet["b"].received == []


class ByAddress(MemoryConnector):
    """Connects a node to the fake named by its URL's host, whatever the node's own name.

    So a reload that changes a node's URL moves its traffic to another fake.
    """

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        host = urlsplit(node.url).hostname or ""
        return await super().connect(attrs.evolve(node, name=host.removesuffix(".invalid")))


async def test_a_moved_nodes_next_request_and_check_go_to_its_new_address(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Not to the old one over an idle pooled connection, nor by discovery's old checker."""
    async with Fleet({"old": FakeNode(healthy(b"old")), "new": FakeNode(healthy(b"new"))}) as fleet:
        config = Config(
            upstreams=[Upstream("x", "http://old.invalid:80")],
            admin_listen=None,
            discovery_interval=10.0,
        )
        proxy = Proxy(config, connector=ByAddress(fleet.nodes, fleet.connector.nursery))
        await start_in_fleet(proxy, discovery=True)
        with trio.fail_after(100):
            await trio.sleep(1)  # discovery's first check of the old address is done
            before = await request(proxy, body=BODY)
            assert before is not None
            assert before.body == b"old"
            assert proxy.pool.idle_count("x") == 1  # fresh: the pool would hand it out
            moved = attrs.evolve(config, upstreams=[Upstream("x", "http://new.invalid:80")])
            result = await proxy.reload(moved)
            assert result.changes == ("node x: url changed",)
            after = await request(proxy, body=BODY)
            assert after is not None
            assert after.body == b"new"
            await trio.sleep(25)
        since = [(r.method, r.target) for r in fleet["old"].received if r.at >= 1.0]
        assert since == [(b"POST", b"/v1/chat/completions")]  # the one before the reload
        new_checks = [r.at for r in fleet["new"].received if r.target == b"/health"]
        assert new_checks[0] == 1.0  # checked at once, then each interval
        assert len(new_checks) >= 3


@pytest.mark.parametrize(
    ("behaviour", "served_by", "at"),
    [
        pytest.param(slow_head(5.0, b"C"), b"C", 5.0, id="alive-served"),
        pytest.param(frozen(), b"A", 4.0, id="frozen-failed-over"),
    ],
)
async def test_an_added_node_that_stays_silent_past_the_header_timeout_is_checked(
    autojump_clock: trio.abc.Clock, behaviour: Any, served_by: bytes, at: float
) -> None:
    """An unstreamed request at a node a reload added gets its liveness checks, not a 502."""
    fleet_nodes = {"a": FakeNode(healthy(b"A")), "c": FakeNode(behaviour)}
    async with Fleet(fleet_nodes) as fleet:
        config = Config(upstreams=nodes(fleet, "a"), admin_listen=None, response_header_timeout=2.0)
        proxy = Proxy(config, connector=fleet.connector)
        assert (
            await proxy.reload(
                attrs.evolve(config, upstreams=[*nodes(fleet, "c"), *nodes(fleet, "a")])
            )
        ).ok
        unstreamed = json.dumps({"model": "m", "messages": []}).encode()
        with trio.fail_after(100):
            answer = await request(proxy, body=unstreamed)
        assert answer is not None
        assert (answer.status, answer.body, answer.at) == (200, served_by, at)
        checks = [r.at for r in fleet["c"].received if r.target == b"/health"]
        assert checks == [2.0, 4.0] if served_by == b"C" else checks == [2.0]
