"""The discovery loop under MockClock over the in-memory connector.

Exact virtual times: the first check of node ``i`` of ``n`` at ``i/n``, the
next ones one interval after the last began (less jitter), one check per
node at a time, a hanging check ended by its 10 s answer deadline and the
down node's re-checks after 1, 2, 4 s, a node that comes back, the
streaming exemption, and the stale-inventory ``404`` that fails over and
has its node checked again at once. tests/test_discovery_checks.py has the
questions of one check.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from trio_failover import Config, Proxy, Upstream
from trio_failover.core.checks import CHECK_JITTER
from trio_failover.core.inventory import (
    CHECK_ANSWER_TIMEOUT,
    CheckFailure,
    judge_check,
)
from trio_failover.proxy.nodes.discovery import Discovery
from trio_failover.telemetry.events import Subscription
from trio_failover.testing import (
    Behaviour,
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    frozen,
    healthy,
    request,
)

CHAT = "/v1/chat/completions"


def listing(*ids: str) -> Behaviour:
    """An OpenAI-style ``GET /v1/models`` answer."""
    document = {"object": "list", "data": [{"id": name, "object": "model"} for name in ids]}
    return healthy(json.dumps(document).encode())


def routed(routes: Mapping[bytes, Behaviour], default: Behaviour | None = None) -> Behaviour:
    """Answers each path with its own behaviour (``default`` for the rest)."""
    other = default or healthy(b'{"ok": true}')

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await routes.get(request.target.split(b"?")[0], other)(io, request)

    return behave


def checks(node: FakeNode) -> list[float]:
    """When ``node`` was asked each check's ``GET /v1/models``."""
    return [r.at for r in node.received if r.target == b"/v1/models"]


def health_checks(node: FakeNode) -> list[float]:
    """When ``node`` was asked each check's ``GET /health``."""
    return [r.at for r in node.received if r.target == b"/health"]


def chat(model: str | None = None) -> bytes:
    return json.dumps({"model": model, "messages": []} if model else {"messages": []}).encode()


def node_events(subscription: Subscription) -> list[dict[str, Any]]:
    """The node events published so far (workload events left out)."""
    events = []
    while True:
        try:
            event = subscription.receive.receive_nowait()
        except trio.WouldBlock:
            return [event for event in events if event["type"] == "node"]
        events.append(event)


def node_status(proxy: Proxy, name: str) -> dict[str, Any]:
    [node] = [node for node in proxy.status()["nodes"] if node["name"] == name]
    return node


@asynccontextmanager
async def checking(
    fleet: Fleet, *, interval: float = 30.0, jitter: float = 0.0, **settings: Any
) -> AsyncIterator[Proxy]:
    """A proxy over ``fleet`` with its discovery running (jitter fixed for exact times)."""
    config = Config(
        upstreams=fleet.upstreams(), admin_listen=None, discovery_interval=interval, **settings
    )
    proxy = Proxy(config, connector=fleet.connector)
    proxy.discovery = Discovery(
        config, fleet.connector, proxy.board, proxy.queue, proxy.report, jitter=lambda: jitter
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.run)
        yield proxy
        nursery.cancel_scope.cancel()


async def test_first_checks_spread_over_a_second_then_one_per_interval(
    autojump_clock: trio.abc.Clock,
) -> None:
    nodes = {name: FakeNode(listing("m")) for name in "abc"}
    async with Fleet(nodes) as fleet, checking(fleet, interval=30.0):
        await trio.sleep(61.0)
    for index, name in enumerate("abc"):
        first = 1.0 * index / 3  # node i of n at i/n of the first second
        assert checks(nodes[name]) == [first, first + 30.0, first + 30.0 + 30.0]


async def test_jitter_brings_a_check_early_never_late(autojump_clock: trio.abc.Clock) -> None:
    node = FakeNode(listing("m"))
    async with Fleet({"a": node}) as fleet, checking(fleet, interval=10.0, jitter=1.0):
        await trio.sleep(25.0)
    early = 10.0 * (1 - CHECK_JITTER)  # the most jitter takes off an interval
    assert checks(node) == [0.0, early, 2 * early]


async def test_a_hanging_check_times_out_marks_down_and_is_never_doubled(
    autojump_clock: trio.abc.Clock,
) -> None:
    hanging = FakeNode(routed({b"/health": frozen()}, listing("m")))
    async with Fleet({"a": hanging}) as fleet, checking(fleet, interval=30.0) as proxy:
        with proxy.events.subscribe(0) as subscription:
            await trio.sleep(CHECK_ANSWER_TIMEOUT + 0.5)
            status = node_status(proxy, "a")
            events = node_events(subscription)
        await trio.sleep(50.0)
    # Each check waits for the one before: at 0, its deadline at 10 ends it;
    # the node is down, so the next comes 1 s after (11), then 2 s after the
    # end of that one (23), then 4 (37); never two at once. /v1/models is
    # never asked of a node that /health found down.
    assert health_checks(hanging) == [0.0, 11.0, 23.0, 37.0, 55.0]
    assert checks(hanging) == []
    # Each closed at its deadline; the last one when the test ended.
    assert hanging.closed_at == [10.0, 21.0, 33.0, 47.0, 60.5]
    assert status["state"] == "down"
    assert status["reason"] == "health_check"
    assert status["last_outcome"] == "check_timed_out"
    assert status["last_error"] == (
        "health check: /health timed out (answer: no whole answer in 10.0s)"
    )
    assert events == [
        {"type": "node", "node": "a", "state": "down", "reason": "health_check", "until_s": 0}
    ]
    [(_, sample)] = [
        (s.labels, s.value)
        for family in proxy.metrics.registry.collect()
        if family.name == "trio_failover_health_checks"
        for s in family.samples
        if s.name.endswith("_total") and s.labels == {"node": "a", "result": "timed_out"}
    ]
    assert sample == 4


async def test_a_down_node_goes_last_and_is_ready_again_after_the_next_good_check(
    autojump_clock: trio.abc.Clock,
) -> None:
    a, b = FakeNode(listing("m"), refuse=True), FakeNode(healthy(b"from b"))
    async with Fleet({"a": a, "b": b}) as fleet, checking(fleet, interval=30.0) as proxy:
        await trio.sleep(0.5)
        assert node_status(proxy, "a")["state"] == "down"
        assert node_status(proxy, "a")["last_outcome"] == "check_connect_failed"
        response = await request(proxy, body=chat())
        assert response is not None
        # b first: a down node is demoted, and b's answer needs no second attempt.
        assert (response.header("x-failover-node"), response.header("x-failover-attempts")) == (
            "b",
            "1",
        )
        await trio.sleep(1.0)  # the re-check at 1.0 still finds it refusing
        a.refuse = False  # a comes back
        with proxy.events.subscribe(0) as subscription:
            await trio.sleep(2.0)  # a's next check is at 3.0 (1 s, then 2 s after)
            ready = node_events(subscription)
        status = node_status(proxy, "a")
    assert health_checks(a) == [3.0]  # the first that connected
    assert ready == [
        {"type": "node", "node": "a", "state": "ready", "reason": "health_check", "until_s": 0}
    ]
    assert (status["state"], status["reason"], status["models"]) == ("ready", None, ["m"])
    assert status["last_outcome"] == "check_ok"


async def test_a_slow_check_of_a_streaming_node_does_not_count(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The node streams a 20 s answer to our client and is too busy to answer
    # /health in time; a second check, with nothing streaming, does count.
    busy = FakeNode(
        routed(
            {b"/health": frozen()},
            healthy([b"data: %d\n\n" % i for i in range(21)], chunk_delay=1.0),
        )
    )
    async with Fleet({"a": busy}) as fleet:
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, discovery_interval=30.0)
        proxy = Proxy(config, connector=fleet.connector)
        proxy.discovery = Discovery(
            config,
            fleet.connector,
            proxy.board,
            proxy.queue,
            proxy.report,
            jitter=lambda: 0.0,
            moving=proxy.silence.moving,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: request(proxy, body=chat()))
            await trio.sleep(0.5)  # committed, streaming
            # The request started the proxy without checks (the kit's way);
            # the checks alone from now on: the first at 0.5.
            await nursery.start(proxy.discovery.run)
            await trio.sleep(10.0 + 0.25)  # its deadline passed at 10.5
            during = node_status(proxy, "a")
            await trio.sleep(30.0)  # the second check, 30.5 to 40.5, with no stream
            after = node_status(proxy, "a")
            nursery.cancel_scope.cancel()
    assert (during["state"], during["last_outcome"]) == ("ready", "check_timeout_while_streaming")
    assert (after["state"], after["last_outcome"]) == ("down", "check_timed_out")
    assert health_checks(busy) == [0.5, 30.5]
    assert checks(busy) == []  # in flight, then down: /v1/models never asked


async def test_a_stale_inventory_404_fails_over_uncooled_and_rechecks_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    # a listed m1 at its first check, then unloaded it: its next listing is
    # empty and a request for m1 gets Ollama's 404.
    listings = [listing("m1"), listing("m2")]
    not_found = healthy(b'{"error": "model \'m1\' not found"}', status=404)

    async def list_then_change(io: NodeIO, request: ReceivedRequest) -> None:
        await listings[min(len(checks(a)) - 1, 1)](io, request)

    a = FakeNode(routed({b"/v1/models": list_then_change}, not_found))
    b = FakeNode(routed({b"/v1/models": listing("m1")}, healthy(b"from b")))
    async with Fleet({"a": a, "b": b}) as fleet, checking(fleet, interval=30.0) as proxy:
        await trio.sleep(5.0)
        assert node_status(proxy, "a")["models"] == ["m1"]
        first = await request(proxy, body=chat("m1"))
        await trio.sleep(0.001)  # the re-check runs at once (no time passes in memory)
        second = await request(proxy, body=chat("m1"))
        status = node_status(proxy, "a")
    assert first is not None
    assert second is not None
    assert (first.status, first.header("x-failover-node")) == (200, "b")
    assert [x["outcome"] for x in proxy.recent[0]["attempts"]] == ["model_not_found", "completed"]
    assert not proxy.cooldowns.is_cooling("a", 5.0)
    assert checks(a) == [0.0, 5.0]  # the re-check, not 30 s later
    assert status["models"] == ["m2"]
    # The healed inventory sends m1 to b alone: one attempt.
    assert (second.header("x-failover-node"), second.header("x-failover-attempts")) == ("b", "1")


async def test_every_node_404_gives_the_last_node_answer(autojump_clock: trio.abc.Clock) -> None:
    # model_not_found is a retryable answer: the client gets the
    # last node's 404 as the node sent it, not a 502 of the proxy's.
    body = b'{"error": {"message": "no such model", "code": "model_not_found"}}'
    nodes = {name: FakeNode(healthy(body, status=404)) for name in "ab"}
    async with Fleet(nodes) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        response = await request(proxy, body=chat("gone"))
    assert response is not None
    assert (response.status, response.body) == (404, body)
    assert response.header("x-failover-node") == "b"
    assert response.header("x-failover-attempts") == "2"


async def test_discovery_off_checks_nothing(autojump_clock: trio.abc.Clock) -> None:
    node = FakeNode(listing("m"))
    async with Fleet({"a": node}) as fleet, checking(fleet, interval=0):
        await trio.sleep(100.0)
    assert node.received == []


async def test_a_served_request_makes_a_down_node_ready(autojump_clock: trio.abc.Clock) -> None:
    a = FakeNode(healthy(b"from a"), refuse=True)
    async with Fleet({"a": a}) as fleet, checking(fleet, interval=600.0) as proxy:
        await trio.sleep(0.5)  # before its re-check at 1.0
        assert node_status(proxy, "a")["state"] == "down"
        assert proxy.metrics.registry.get_sample_value("trio_failover_down_nodes") == 1
        a.refuse = False  # back, long before its next check
        with proxy.events.subscribe(0) as subscription:
            response = await request(proxy, body=chat())  # a sole node: demoted, still tried
            events = node_events(subscription)
        status = node_status(proxy, "a")
    assert response is not None
    assert response.status == 200
    assert events == [
        {"type": "node", "node": "a", "state": "ready", "reason": "success", "until_s": 0}
    ]
    assert (status["state"], status["last_outcome"]) == ("ready", "completed")
    assert proxy.metrics.registry.get_sample_value("trio_failover_down_nodes") == 0
    # The check's error stays as the last one seen.
    assert status["last_error"].startswith("health check cannot connect (connect: ")


async def test_status_models_are_the_configured_ones_else_the_inventory(
    autojump_clock: trio.abc.Clock,
) -> None:
    nodes = {name: FakeNode(listing("listed")) for name in ("mapped", "plain", "star")}
    async with Fleet(nodes) as fleet:
        upstreams = [
            Upstream("mapped", "http://mapped.invalid", models={"qwen3": "Qwen/Qwen3", "*": "x"}),
            Upstream("plain", "http://plain.invalid"),
            Upstream("star", "http://star.invalid", models={"*": "x"}),
        ]
        config = Config(upstreams=upstreams, admin_listen=None, discovery_interval=30.0)
        proxy = Proxy(config, connector=fleet.connector)
        before = {n["name"]: n["models"] for n in proxy.status()["nodes"]}
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            await trio.sleep(1.0)
            after = {n["name"]: n["models"] for n in proxy.status()["nodes"]}
            nursery.cancel_scope.cancel()
    # "*" alone names no id of its own: unknown until its inventory is.
    assert before == {"mapped": ["qwen3"], "plain": None, "star": None}
    # Configured names win over the inventory; "*" alone lists its inventory (issue 27).
    assert after == {"mapped": ["qwen3"], "plain": ["listed"], "star": ["listed"]}


async def test_down_outranks_cooling_and_an_expiry_is_no_ready_news(
    autojump_clock: trio.abc.Clock,
) -> None:
    config = Config(upstreams=[Upstream("a", "http://a.invalid")], admin_listen=None)
    proxy = Proxy(config)
    board = proxy.board
    with proxy.events.subscribe(0) as subscription:
        board.demote("a", 5.0, "header_timeout", trio.current_time())
        down = judge_check(failure=CheckFailure.CONNECT_FAILED, detail="refused")
        board.check_finished("a", down, trio.current_time())
        both = node_status(proxy, "a")
        await trio.sleep(6.0)
        proxy.expire_cooldowns()  # the cooldown is over, but the node is still down
        after = node_status(proxy, "a")
        events = node_events(subscription)
    assert (both["state"], both["reason"], both["cooldown_remaining_s"]) == (
        "down",
        "health_check",
        5.0,
    )
    assert (after["state"], after["cooldown_remaining_s"]) == ("down", 0)
    assert [event["state"] for event in events] == ["cooling", "down"]
    assert board.is_demoted("a", trio.current_time())


# -- names the engines serve (issue 27) ---------------------------------------------


def served_models(node: FakeNode) -> list[str]:
    """The ``"model"`` of each request ``node`` was sent (its checks left out)."""
    return [r.json()["model"] for r in node.received if r.method == b"POST"]


async def test_a_bare_name_reaches_the_ollama_node_that_lists_it_tagged(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Ollama lists llama3.2:latest and serves "llama3.2"; on main the proxy
    # said 404 model_not_found once the first check had run.
    ollama = FakeNode(routed({b"/v1/models": listing("llama3.2:latest")}, healthy(b"from a")))
    other = FakeNode(routed({b"/v1/models": listing("qwen3:8b")}, healthy(b"from b")))
    async with Fleet({"b": other, "a": ollama}) as fleet, checking(fleet) as proxy:
        await trio.sleep(1.0)  # both first checks done
        assert node_status(proxy, "a")["models"] == ["llama3.2:latest"]
        bare = await request(proxy, body=chat("llama3.2"))
        tagged = await request(proxy, body=chat("llama3.2:latest"))
    assert bare is not None
    assert tagged is not None
    # Straight to a, one attempt each; b (which lists other names) never asked.
    assert (bare.status, bare.header("x-failover-node"), bare.header("x-failover-attempts")) == (
        200,
        "a",
        "1",
    )
    assert (tagged.status, tagged.header("x-failover-node")) == (200, "a")
    # The node is sent the client's name, as the client spelled it.
    assert served_models(ollama) == ["llama3.2", "llama3.2:latest"]
    assert served_models(other) == []


async def test_a_single_model_engine_serves_any_name_once_checked(
    autojump_clock: trio.abc.Clock,
) -> None:
    # llama-server with one model lists its alias ("tiny") and serves any
    # name: "gpt-4o-mini" was a 404 on main once its inventory was known.
    engine = FakeNode(routed({b"/v1/models": listing("tiny")}, healthy(b"from a")))
    async with Fleet({"a": engine}) as fleet, checking(fleet) as proxy:
        await trio.sleep(1.0)
        assert node_status(proxy, "a")["models"] == ["tiny"]
        responses = [
            await request(proxy, body=chat(name)) for name in ("gpt-4o-mini", "tiny:latest")
        ]
    assert [(r.status, r.header("x-failover-node")) for r in responses if r] == [
        (200, "a"),
        (200, "a"),
    ]
    assert served_models(engine) == ["gpt-4o-mini", "tiny:latest"]


async def test_a_name_no_node_lists_goes_to_every_node_and_a_404_moves_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    # a (vLLM-like) refuses names it does not list with model_not_found; b
    # (a single-model engine) serves any. Nobody lists "gpt-4o-mini": both
    # are candidates in ranking order; a's 404 moves on to b, no cooldown.
    not_found = healthy(b'{"error": {"message": "no", "code": "model_not_found"}}', status=404)
    strict = FakeNode(routed({b"/v1/models": listing("Qwen/Qwen3-8B")}, not_found))
    lenient = FakeNode(routed({b"/v1/models": listing("tiny")}, healthy(b"from b")))
    async with Fleet({"a": strict, "b": lenient}) as fleet, checking(fleet) as proxy:
        await trio.sleep(1.0)
        response = await request(proxy, body=chat("gpt-4o-mini"))
        listed = await request(proxy, body=chat("tiny"))  # b lists it: b alone
        cooling = proxy.cooldowns.is_cooling("a", trio.current_time())
    assert response is not None
    assert listed is not None
    assert (response.status, response.header("x-failover-node")) == (200, "b")
    assert [x["outcome"] for x in proxy.recent[0]["attempts"]] == ["model_not_found", "completed"]
    assert not cooling
    assert (listed.header("x-failover-node"), listed.header("x-failover-attempts")) == ("b", "1")
    assert served_models(strict) == ["gpt-4o-mini"]
