"""Per-model cooldowns, whole proxy under MockClock over fake nodes.

On a node that serves more than one model a head stall, a first-body stall
or a 429 demotes that node for the model asked for only; a node gone quiet
(``unresponsive``: its liveness check got no answer either) is demoted
whole, and so is a node serving one model. A served answer for the model
ends its cooldown.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
import trio
import trio.testing

from trio_failover import Config, Upstream
from trio_failover.core.node_change import NodeChange
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    Behaviour,
    ClientResponse,
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    frozen,
    healthy,
    request,
    retry_status,
    slow_head,
)

LIMIT = 3600.0
HEADER_TIMEOUT = 120.0  # the default --response-header-timeout


def body_of(model: str) -> bytes:
    return json.dumps({"model": model, "messages": []}).encode()


def by_model(behaviours: Mapping[str, Behaviour], default: Behaviour) -> Behaviour:
    """Answers each completion by its ``model``; every other request (``/health``) with 200."""
    ok = healthy()

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if request.method != b"POST":
            await ok(io, request)
            return
        model = str(request.json().get("model"))
        await behaviours.get(model, default)(io, request)

    return behave


def proxy_over(fleet: Fleet, models: Mapping[str, list[str]]) -> Proxy:
    upstreams = [
        attrs.evolve(node, models=models[node.name]) if node.name in models else node
        for node in fleet.upstreams()
    ]
    return Proxy(Config(upstreams=upstreams, admin_listen=None), connector=fleet.connector)


async def ask(proxy: Proxy, model: str) -> ClientResponse:
    response = await request(proxy, body=body_of(model))
    assert response is not None
    return response


def node_of(response: ClientResponse) -> str | None:
    return response.header("x-failover-node")


def status_of(proxy: Proxy, name: str) -> dict[str, Any]:
    return next(node for node in proxy.status()["nodes"] if node["name"] == name)


async def test_a_stall_for_model_x_leaves_the_node_ready_for_y(
    autojump_clock: trio.abc.Clock,
) -> None:
    a = FakeNode(by_model({"x": frozen()}, healthy(b'{"from": "a"}')))
    async with Fleet({"a": a, "b": FakeNode(healthy(b'{"from": "b"}'))}) as fleet:
        proxy = proxy_over(fleet, {"a": ["x", "y"], "b": ["x", "y"]})
        with trio.fail_after(LIMIT):
            first = await ask(proxy, "x")  # a stalls for x: on to b
            for_y = await ask(proxy, "y")
            for_x = await ask(proxy, "x")
            node = status_of(proxy, "a")
    assert (node_of(first), node_of(for_y), node_of(for_x)) == ("b", "a", "b")
    assert [r.json()["model"] for r in a.received if r.method == b"POST"] == ["x", "y"]
    assert node["state"] == "ready"
    assert node["models_cooling"] == {
        "x": {"remaining_s": HEADER_TIMEOUT, "reason": "header_timeout"}
    }
    assert not proxy.board.is_demoted("a", trio.current_time())
    assert proxy.board.is_demoted("a", trio.current_time(), "x:latest")  # the same model


async def test_a_429_for_x_demotes_x_only(autojump_clock: trio.abc.Clock) -> None:
    limited = retry_status(429, headers=[("retry-after", "30")])
    a = FakeNode(by_model({"x": limited}, healthy()))
    async with Fleet({"a": a, "b": FakeNode(healthy())}) as fleet:
        proxy = proxy_over(fleet, {"a": ["x", "y"], "b": ["x", "y"]})
        with trio.fail_after(LIMIT):
            assert node_of(await ask(proxy, "x")) == "b"
            assert node_of(await ask(proxy, "y")) == "a"
            assert node_of(await ask(proxy, "x")) == "b"
            cooling = status_of(proxy, "a")["models_cooling"]
    assert [r.json()["model"] for r in a.received if r.method == b"POST"] == ["x", "y"]
    assert list(cooling) == ["x"]
    assert cooling["x"]["reason"] == "retryable_response"
    labels = {"node": "a", "model": "x", "reason": "retryable_response"}
    sample = proxy.metrics.registry.get_sample_value
    assert sample("trio_failover_model_cooldowns_total", labels) == 1
    assert (
        sample("trio_failover_cooldowns_total", {"node": "a", "reason": "retryable_response"})
        is None
    )


async def test_an_unresponsive_node_is_demoted_whole(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy())}) as fleet:
        proxy = proxy_over(fleet, {"a": ["x", "y"], "b": ["x", "y"]})
        with trio.fail_after(LIMIT):
            first = await ask(proxy, "x")  # no head, and no answer to GET /health
            for_y = await ask(proxy, "y")
            node = status_of(proxy, "a")
    assert (node_of(first), node_of(for_y)) == ("b", "b")
    assert node["state"] == "down"  # the node, not a model: down until it answers
    assert node["reason"] == "unresponsive"
    assert node["models_cooling"] == {}


async def test_a_node_serving_one_model_is_demoted_whole(autojump_clock: trio.abc.Clock) -> None:
    a = FakeNode(by_model({"x": frozen()}, healthy()))
    async with Fleet({"a": a, "b": FakeNode(healthy())}) as fleet:
        proxy = proxy_over(fleet, {})  # nothing configured, no inventory: one model
        with trio.fail_after(LIMIT):
            assert node_of(await ask(proxy, "x")) == "b"
            assert node_of(await ask(proxy, "y")) == "b"
            node = status_of(proxy, "a")
    assert (node["state"], node["reason"]) == ("cooling", "header_timeout")
    assert node["models_cooling"] == {}


async def test_a_served_answer_for_x_ends_xs_cooldown(autojump_clock: trio.abc.Clock) -> None:
    stalling = {"x": frozen()}
    a = FakeNode(by_model(stalling, healthy()))
    async with Fleet({"a": a, "b": FakeNode(frozen())}) as fleet:
        proxy = proxy_over(fleet, {"a": ["x", "y"], "b": ["x", "y"]})
        events: list[dict[str, Any]] = []
        proxy.board.listen(
            lambda change: (
                events.append({"kind": str(change.kind), "model": change.model})
                if isinstance(change, NodeChange)
                else None
            )
        )
        with trio.fail_after(LIMIT):
            proxy.board.demote("a", 60.0, "header_timeout", trio.current_time(), model="x")
            proxy.board.demote("b", 600.0, "unresponsive", trio.current_time())
            stalling.clear()  # a serves x again
            # b cools whole and a only for x: a is the better of the two.
            assert node_of(await ask(proxy, "x")) == "a"
            node = status_of(proxy, "a")
    assert node["models_cooling"] == {}
    assert {"kind": "ready", "model": "x"} in events


async def test_a_model_cooldown_runs_out_and_a_waiter_for_it_is_dispatched(
    autojump_clock: trio.abc.Clock,
) -> None:
    slow = FakeNode(slow_head(100.0))  # busy: its health route answers meanwhile
    async with Fleet({"a": FakeNode(healthy()), "b": slow}) as fleet:
        upstreams = [
            Upstream(name, f"http://{name}.invalid:80", models=["x", "y"], capacity=1)
            for name in "ab"
        ]
        config = Config(upstreams=upstreams, admin_listen=None, discovery_interval=0)
        proxy = Proxy(config, connector=fleet.connector)
        heard: list[tuple[str, str | None]] = []
        proxy.board.listen(
            lambda change: (
                heard.append((str(change.kind), change.model))
                if isinstance(change, NodeChange)
                else None
            )
        )
        took: dict[str, float] = {}
        served: dict[str, str | None] = {}

        async def one(name: str) -> None:
            started = trio.current_time()
            served[name] = node_of(await ask(proxy, "x"))
            took[name] = trio.current_time() - started

        with trio.fail_after(LIMIT):
            async with proxy:
                proxy.board.demote("a", 30.0, "header_timeout", trio.current_time(), model="x")
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(one, "first")  # a cools for x: b, for 100 s
                    await trio.sleep(1.0)
                    nursery.start_soon(one, "second")  # b is full: it waits
                    await trio.sleep(5.0)
                    proxy.queue.dispatch()  # as any node change would: a is still cooling for x
                    await trio.sleep(25.0)
                    assert heard == [("cooling", "x"), ("ready", "x")]  # the ticker saw the end
    assert served == {"first": "b", "second": "a"}
    assert took["second"] == 29.0  # handed a's slot as x's cooldown ended
