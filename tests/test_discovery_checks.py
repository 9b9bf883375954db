"""The questions of one discovery check, through a whole proxy, under MockClock.

``GET /health`` every time; ``GET /v1/models`` and ``GET /api/tags`` only
while this proxy has no attempt in flight at the node (a stream through the
proxy: the fake node never sees ``/v1/models`` while it runs, and sees it
at the first check after); what each pair of answers does to a node whose
inventory *was* known; and the re-checks of a down node at exact instants,
1, 2, 4, 8 s ... up to the interval.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from tests.test_discovery import (
    chat,
    checking,
    checks,
    health_checks,
    listing,
    node_status,
    routed,
)
from trio_failover import Config, Proxy, Upstream
from trio_failover.core.config import Upstream as UpstreamType
from trio_failover.proxy.nodes.discovery import Discovery
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

OK = healthy(b'{"status": "ok"}')
NOT_FOUND = healthy(b'{"detail": "Not Found"}', status=404)
LOADING = healthy(b'{"error": {"message": "Loading model", "code": 503}}', status=503)
HTML = healthy(b"<html><body>proxy login</body></html>", headers=[("content-type", "text/html")])
TAGS = {"models": [{"name": "m1:latest", "model": "m1:latest", "size": 1}]}


def targets(node: FakeNode) -> list[tuple[float, bytes]]:
    return [(r.at, r.target) for r in node.received]


async def test_a_check_asks_health_then_models_then_tags_each_on_its_own_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    node = FakeNode(
        routed(
            {
                b"/health": OK,
                b"/v1/models": listing("m1"),
                b"/api/tags": healthy(json.dumps(TAGS).encode()),
            }
        )
    )
    async with Fleet({"a": node}) as fleet, checking(fleet, interval=30.0) as proxy:
        assert proxy.known_tags("a") is None  # before the first check
        await trio.sleep(0.5)
        status = node_status(proxy, "a")
        tags = proxy.known_tags("a")
    assert targets(node) == [(0.0, b"/health"), (0.0, b"/v1/models"), (0.0, b"/api/tags")]
    assert node.connections == 3
    assert (status["state"], status["models"], status["last_outcome"]) == (
        "ready",
        ["m1"],
        "check_ok",
    )
    assert tags == TAGS["models"]


async def test_the_last_tags_answer_is_kept_a_404_forgets_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    answers: list[Behaviour] = [healthy(json.dumps(TAGS).encode()), frozen(), NOT_FOUND]

    async def tags(io: NodeIO, request: ReceivedRequest) -> None:
        await answers[len([r for r in node.received if r.target == b"/api/tags"]) - 1](io, request)

    node = FakeNode(routed({b"/health": OK, b"/v1/models": listing("m1"), b"/api/tags": tags}))
    async with Fleet({"a": node}) as fleet, checking(fleet, interval=30.0) as proxy:
        await trio.sleep(1.0)
        first = proxy.known_tags("a")
        await trio.sleep(30.0 + 10.0)  # the second check's /api/tags timed out at 40
        after_timeout = proxy.known_tags("a")
        await trio.sleep(30.0)  # the third, at 60, answers 404
        after_404 = proxy.known_tags("a")
        status = node_status(proxy, "a")
    assert first == after_timeout == TAGS["models"]
    assert after_404 is None
    # /api/tags is no health question: its 404 and its timeout leave the node alone.
    assert (status["state"], status["last_outcome"], status["last_error"]) == (
        "ready",
        "check_ok",
        None,
    )


async def test_discovery_off_knows_no_tags(autojump_clock: trio.abc.Clock) -> None:
    node = FakeNode(healthy(json.dumps(TAGS).encode()))
    async with Fleet({"a": node}) as fleet, checking(fleet, interval=0) as proxy:
        await trio.sleep(5.0)
        assert proxy.known_tags("a") is None


# -- a node whose inventory was known (m1), then a later check ----------------------------

# (its /health, its later /v1/models) -> (state, models, last_outcome, last_error)
LATER = [
    pytest.param(
        OK,
        HTML,
        ("ready", None, "check_bad_body", "health check: /v1/models answered 200, not a"),
        id="health-ok-models-html",
    ),
    pytest.param(
        OK,
        NOT_FOUND,
        ("ready", None, "check_bad_status", "health check: /v1/models answered 404"),
        id="health-ok-models-404",
    ),
    pytest.param(OK, listing(), ("ready", None, "check_ok", None), id="health-ok-empty-list"),
    pytest.param(
        NOT_FOUND,
        HTML,
        ("ready", None, "check_bad_body", "health check: /v1/models answered 200, not a"),
        id="no-health-route-models-html",
    ),
    pytest.param(
        NOT_FOUND,
        NOT_FOUND,
        ("ready", None, "check_bad_status", "health check: /v1/models answered 404"),
        id="no-health-route-models-404",
    ),
    pytest.param(
        NOT_FOUND, listing(), ("ready", None, "check_ok", None), id="no-health-route-empty-list"
    ),
    pytest.param(
        OK,
        LOADING,
        ("ready", ["m1"], "check_models_server_error", "health check: /v1/models answered 503"),
        id="health-ok-models-503-kept",
    ),
    pytest.param(
        NOT_FOUND,
        LOADING,
        ("down", ["m1"], "check_server_error", "health check: /v1/models answered 503"),
        id="no-health-route-models-503-down-kept",
    ),
    pytest.param(
        OK,
        frozen(),
        ("ready", ["m1"], "check_models_timed_out", "health check: /v1/models timed out"),
        id="health-ok-models-hang-kept",
    ),
    pytest.param(
        NOT_FOUND,
        frozen(),
        ("down", ["m1"], "check_timed_out", "health check: /v1/models timed out"),
        id="no-health-route-models-hang-down-kept",
    ),
]


@pytest.mark.parametrize(("health", "later", "expected"), LATER)
async def test_a_later_answer_about_a_known_inventory(
    autojump_clock: trio.abc.Clock,
    health: Behaviour,
    later: Behaviour,
    expected: tuple[str, list[str] | None, str, str | None],
) -> None:
    # a listed m1 at its first check; b lists m2. A request for m2 shows
    # what routing believes: a kept inventory (m1) leaves a out, an unknown
    # one makes a a candidate for every model, first in ranking order.
    phase = {"later": False}

    async def models(io: NodeIO, request: ReceivedRequest) -> None:
        await (later if phase["later"] else listing("m1"))(io, request)

    a = FakeNode(routed({b"/health": health, b"/v1/models": models}, healthy(b"from a")))
    b = FakeNode(routed({b"/v1/models": listing("m2")}, healthy(b"from b")))
    async with Fleet({"a": a, "b": b}) as fleet, checking(fleet, interval=30.0) as proxy:
        await trio.sleep(1.0)
        assert node_status(proxy, "a")["models"] == ["m1"]
        phase["later"] = True
        await trio.sleep(29.0 + 10.5)  # a's second check at 30 (10 s if /v1/models hangs)
        status = node_status(proxy, "a")
        response = await request(proxy, body=chat("m2"))
    state, models_after, outcome, error = expected
    assert (status["state"], status["models"], status["last_outcome"]) == (
        state,
        models_after,
        outcome,
    )
    if error is None:
        assert status["last_error"] is None
    else:
        assert status["last_error"].startswith(error)
    assert response is not None
    unknown = models_after is None
    assert response.header("x-failover-node") == ("a" if unknown else "b")


async def test_a_down_health_route_asks_nothing_more_and_keeps_the_inventory(
    autojump_clock: trio.abc.Clock,
) -> None:
    phase = {"later": False}

    async def health(io: NodeIO, request: ReceivedRequest) -> None:
        await (LOADING if phase["later"] else OK)(io, request)

    a = FakeNode(routed({b"/health": health, b"/v1/models": listing("m1")}))
    async with Fleet({"a": a}) as fleet, checking(fleet, interval=30.0) as proxy:
        await trio.sleep(1.0)
        phase["later"] = True
        await trio.sleep(29.5)
        status = node_status(proxy, "a")
    assert (status["state"], status["models"], status["last_outcome"]) == (
        "down",
        ["m1"],
        "check_server_error",
    )
    assert status["last_error"] == "health check: /health answered 503"
    assert checks(a) == [0.0]  # the down check at 30 and its re-check at 31: /health alone
    assert health_checks(a) == [0.0, 30.0]


# -- no /v1/models while an attempt is in flight ------------------------------------------


@pytest.mark.parametrize("capacity", [0, 1, 4])
@pytest.mark.parametrize("health", [OK, NOT_FOUND], ids=["llama-server", "llama-cpp-python"])
async def test_no_inventory_question_while_a_stream_runs_through_the_proxy(
    autojump_clock: trio.abc.Clock, capacity: int, health: Behaviour
) -> None:
    # The stream runs from 0.5 to 20.5; checks every 2 s. Each asks /health;
    # /v1/models and /api/tags wait until the first check after the stream.
    chunks = [b"data: %d\n\n" % i for i in range(21)]
    node = FakeNode(
        routed(
            {b"/health": health, b"/v1/models": listing("m1"), b"/api/tags": NOT_FOUND},
            healthy(chunks, chunk_delay=1.0, headers=[("content-type", "text/event-stream")]),
        )
    )
    async with Fleet({"a": node}) as fleet:
        upstreams = [Upstream("a", "http://a.invalid", capacity=capacity)]
        config = Config(upstreams=upstreams, admin_listen=None, discovery_interval=2.0)
        proxy = Proxy(config, connector=fleet.connector)
        proxy.discovery = Discovery(
            config, fleet.connector, proxy.board, proxy.queue, proxy.report, jitter=lambda: 0.0
        )
        answers: list[Any] = []

        async def client() -> None:
            answers.append(await request(proxy, body=chat()))
            answers.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            await trio.sleep(0.5)
            nursery.start_soon(client)
            await trio.sleep(19.75)
            during = node_status(proxy, "a")  # at 20.25: the check at 20 is the last one
            await trio.sleep(2.0)
            after = node_status(proxy, "a")
            nursery.cancel_scope.cancel()
    [response, ended] = answers
    assert response is not None
    assert (response.status, response.body) == (200, b"".join(chunks))
    assert ended == 20.5
    assert health_checks(node) == [float(t) for t in range(0, 23, 2)]
    assert checks(node) == [0.0, 22.0]  # never during the stream, again at once after it
    assert [r.at for r in node.received if r.target == b"/api/tags"] == [0.0, 22.0]
    expected_outcome = "check_ok_inventory_waits" if health is OK else "check_inventory_waits"
    assert (during["state"], during["models"], during["last_outcome"]) == (
        "ready",
        ["m1"],
        expected_outcome,
    )
    assert (after["state"], after["models"], after["last_outcome"]) == ("ready", ["m1"], "check_ok")


# -- a down node's re-checks ----------------------------------------------------------------


class Recording:
    """A connector that notes when each connection was asked for."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.at: list[float] = []

    async def connect(self, node: UpstreamType) -> trio.abc.Stream:
        self.at.append(trio.current_time())
        return await self.inner.connect(node)  # type: ignore[no-any-return]


# interval, the engine answers from (s), -> the instants of the /health questions
RESTARTS = [
    pytest.param(30.0, 20.0, [0.0, 1.0, 3.0, 7.0, 15.0, 31.0, 61.0], id="back-at-31-not-60"),
    pytest.param(30.0, 2.5, [0.0, 1.0, 3.0, 33.0, 63.0], id="back-within-seconds"),
    pytest.param(
        5.0, 20.0, [0.0, 1.0, 3.0, 7.0, 12.0, 17.0, 22.0, 27.0, 32.0], id="capped-at-interval"
    ),
    pytest.param(
        60.0,
        100.0,
        [0.0, 1.0, 3.0, 7.0, 15.0, 31.0, 63.0, 123.0, 183.0],
        id="1-2-4-8-16-32-then-60",
    ),
]


@pytest.mark.parametrize("how", ["refused", "loading"])
@pytest.mark.parametrize(("interval", "back_at", "expected"), RESTARTS)
async def test_a_down_node_is_checked_after_1_2_4_8_s_up_to_the_interval(
    autojump_clock: trio.abc.Clock, interval: float, back_at: float, expected: list[float], how: str
) -> None:
    # An engine restarts: refused while its process is gone, or llama-server's
    # 503 while it loads; from back_at it answers.
    async def health(io: NodeIO, request: ReceivedRequest) -> None:
        await (OK if trio.current_time() >= back_at else LOADING)(io, request)

    node = FakeNode(routed({b"/health": health if how == "loading" else OK}, listing("m1")))
    async with Fleet({"a": node}) as fleet:
        recording = Recording(fleet.connector)
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, discovery_interval=interval)
        proxy = Proxy(config, connector=recording)
        proxy.discovery = Discovery(
            config, recording, proxy.board, proxy.queue, proxy.report, jitter=lambda: 0.0
        )
        async with trio.open_nursery() as nursery:
            if how == "refused":
                node.refuse = True

                async def restart() -> None:
                    await trio.sleep(back_at)
                    node.refuse = False

                nursery.start_soon(restart)
            await nursery.start(proxy.run)
            await trio.sleep(expected[-1] + 0.5)
            status = node_status(proxy, "a")
            nursery.cancel_scope.cancel()
    # One connection per down check (/health alone); three per good one.
    assert sorted(set(recording.at)) == expected
    assert status["state"] == "ready"


class SlowConnect:
    """A connector whose every connection takes half a second (a far node)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def connect(self, node: UpstreamType) -> trio.abc.Stream:
        await trio.sleep(0.5)
        return await self.inner.connect(node)  # type: ignore[no-any-return]


async def test_an_attempt_that_begins_while_the_check_connects_stops_its_models_question(
    autojump_clock: trio.abc.Clock,
) -> None:
    # 0.0-0.5 /health; 0.5-1.0 the /v1/models connection; a request takes
    # its slot at 0.7. The check asks again once connected, and sends nothing.
    chunks = [b"data: %d\n\n" % i for i in range(5)]
    node = FakeNode(
        routed(
            {b"/health": OK, b"/v1/models": listing("m1"), b"/api/tags": NOT_FOUND},
            healthy(chunks, chunk_delay=1.0, headers=[("content-type", "text/event-stream")]),
        )
    )
    async with Fleet({"a": node}) as fleet:
        slow = SlowConnect(fleet.connector)
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, discovery_interval=30.0)
        proxy = Proxy(config, connector=slow)
        proxy.discovery = Discovery(
            config, slow, proxy.board, proxy.queue, proxy.report, jitter=lambda: 0.0
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            await trio.sleep(0.7)
            response = await request(proxy, body=chat())
            first = node_status(proxy, "a")["last_outcome"]
            await trio.sleep(32.5 - trio.current_time())
            nursery.cancel_scope.cancel()
    assert response is not None
    assert (response.status, response.body) == (200, b"".join(chunks))
    assert health_checks(node) == [0.5, 30.5]
    assert checks(node) == [31.0]  # not at 1.0: the attempt held its slot from 0.7
    assert first == "completed"
    # /health, the unused connection, the attempt; then a whole check at 30.
    assert node.connections == 1 + 1 + 1 + 3


async def test_the_fleets_tags_come_from_the_last_check_without_asking_the_node_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    # /api/tags from each node's last check; asked live only of a
    # node with none yet. After the first check, a frozen /api/tags route
    # would hold the list for 2 s if the node were asked again.
    node = FakeNode(
        routed(
            {
                b"/health": OK,
                b"/v1/models": listing("m1"),
                b"/api/tags": healthy(json.dumps(TAGS).encode()),
            }
        )
    )
    async with Fleet({"a": node}) as fleet, checking(fleet, interval=30.0) as proxy:
        await trio.sleep(1.0)
        asked_before = len(node.received)
        start = trio.current_time()
        answer = await request(proxy, "GET", "/api/tags")
        took = trio.current_time() - start
    assert answer is not None
    assert (answer.status, answer.json(), took) == (200, TAGS, 0.0)
    assert len(node.received) == asked_before  # nothing asked live


async def test_the_fleets_model_list_does_not_ask_a_node_with_an_attempt_in_flight(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Like a check, the fleet's GET /v1/models asks a node without an
    # inventory only while nothing of this proxy runs there (llama-cpp-python
    # would end the running generation); that node is left out meanwhile.
    chunks = [b"data: %d\n\n" % i for i in range(5)]
    node = FakeNode(
        routed(
            {b"/v1/models": listing("m1")},
            healthy(chunks, chunk_delay=1.0, headers=[("content-type", "text/event-stream")]),
        )
    )
    async with Fleet({"a": node}) as fleet:
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, discovery_interval=0)
        proxy = Proxy(config, connector=fleet.connector)
        lists: list[Any] = []

        async def client() -> None:
            await request(proxy, body=chat())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            await trio.sleep(1.5)
            lists.append(await request(proxy, "GET", "/v1/models"))  # at 1.5: busy, unknown
            await trio.sleep(5.0)
            lists.append(await request(proxy, "GET", "/v1/models"))  # at 6.5: asked
            nursery.start_soon(client)
            await trio.sleep(1.0)
            lists.append(await request(proxy, "GET", "/v1/models"))  # at 7.5: busy, known
    _busy_unknown, asked, known = lists
    assert [answer.status for answer in lists] == [502, 200, 200]
    assert [m["id"] for m in asked.json()["data"]] == [m["id"] for m in known.json()["data"]]
    assert [m["id"] for m in known.json()["data"]] == ["m1"]
    assert [r.at for r in node.received if r.target == b"/v1/models"] == [6.5]


async def test_a_discovery_check_is_the_nodes_last_check_in_status(
    autojump_clock: trio.abc.Clock,
) -> None:
    # /status last_check: kind "health" for discovery's checks (beside the
    # liveness checks' "liveness"), ok unless it found the node down.
    node = FakeNode(routed({b"/health": OK, b"/v1/models": listing("m1")}))
    down = FakeNode(routed({b"/health": LOADING}))
    async with (
        Fleet({"a": node, "b": down}) as fleet,
        checking(fleet, interval=30.0) as proxy,
    ):
        await trio.sleep(3.5)
        a, b = node_status(proxy, "a"), node_status(proxy, "b")
    assert a["last_check"]["kind"] == b["last_check"]["kind"] == "health"
    assert (a["last_check"]["ok"], a["last_check"]["error"]) == (True, None)
    assert (b["state"], b["last_check"]["ok"]) == ("down", False)
    assert b["last_check"]["error"] == b["last_error"]
