"""Liveness checks: a silent node is asked ``GET /health``, not guessed about.

Whole-proxy tests over in-memory streams under ``MockClock(autojump_threshold=0)``
(pytest-trio's ``autojump_clock``), so every instant asserted is exact: with
a 2 s response-header timeout an unstreamed request to a frozen node is
checked at t=2 (a watched wait also asks at each header timeout) and moves
on at 2 + min(10, 2) = 4 when the check hangs, at t=2 when it is refused;
with the defaults (120 s, ``--liveness-interval`` 10 s) any wait on a frozen
node is asked at 10 and left at 20.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio

from trio_failover import Config
from trio_failover.core.config import Upstream
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    FakeNode,
    Fleet,
    ReceivedRequest,
    frozen,
    frozen_after_head,
    headers_then_silence,
    healthy,
    request,
    slow_prefill,
    with_health,
)

LIMIT = 3600  # virtual seconds; every test ends long before
UNSTREAMED = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
STREAMED = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def make_proxy(fleet: Fleet, *, upstreams: list[Upstream] | None = None, **settings: Any) -> Proxy:
    settings.setdefault("response_header_timeout", 2.0)
    config = Config(upstreams=upstreams or fleet.upstreams(), admin_listen=None, **settings)
    return Proxy(config, connector=fleet.connector)


def outcomes(proxy: Proxy) -> list[list[tuple[str, str]]]:
    """(node, outcome) per attempt, per finished workload."""
    return [[(a["node"], a["outcome"]) for a in w["attempts"]] for w in proxy.recent]


def health_checks(node: FakeNode) -> list[ReceivedRequest]:
    return [r for r in node.received if r.method == b"GET" and r.target.endswith(b"/health")]


def check_times(node: FakeNode) -> list[float]:
    return [r.at for r in health_checks(node)]


def status_of(proxy: Proxy, name: str) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = proxy.status()["nodes"]
    return next(node for node in nodes if node["name"] == name)


async def refuse_after_first_request(node: FakeNode) -> None:
    """The node's listener goes away once the request is in (its accepted connection hangs on)."""
    await node.first_request.wait()
    node.refuse = True


# -- the exact instants ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header_timeout", "moved_on_at"),
    [
        pytest.param(2.0, 4.0, id="check-timeout-is-the-header-timeout"),
        # The interval (10 s) asks before the header timeout; the check's head
        # timeout is min(10, 30).
        pytest.param(30.0, 20.0, id="check-timeout-is-capped-at-10s"),
    ],
)
async def test_a_frozen_node_is_checked_and_left_when_the_check_hangs(
    autojump_clock: trio.abc.Clock, header_timeout: float, moved_on_at: float
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=header_timeout)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert (response.status, response.body) == (200, b"from b")
        assert response.at == moved_on_at  # not the 600 s unstreamed timeout
        assert response.header("x-failover-attempts") == "2"
        assert check_times(fleet["a"]) == [moved_on_at - min(10.0, header_timeout)]
        assert [r.at for r in fleet["b"].received] == [moved_on_at]
        assert outcomes(proxy) == [[("a", "unresponsive"), ("b", "completed")]]
        # Down, not cooling: demoted until a check finds it answering again.
        assert proxy.cooldowns.get("a", trio.current_time()) is None
        assert (status_of(proxy, "a")["state"], status_of(proxy, "a")["reason"]) == (
            "down",
            "unresponsive",
        )


async def test_a_check_refused_at_once_moves_on_at_the_header_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(refuse_after_first_request, fleet["a"])
                response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"from b", 2.0)
        assert fleet["a"].connections == 1  # the check's connection was refused
        assert outcomes(proxy) == [[("a", "unresponsive"), ("b", "completed")]]
        last = status_of(proxy, "a")["last_check"]
        assert last["ok"] is False
        assert last["status"] is None
        assert "refused" in last["error"]


async def test_a_check_that_passes_twice_then_hangs_moves_on_at_the_third_window(
    autojump_clock: trio.abc.Clock,
) -> None:
    node = FakeNode(with_health(frozen(), answers=2))
    async with Fleet({"a": node, "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        # Checks at 2 and 4 pass (each window runs from the answer on); the
        # third, at 6, gets no head in 2 s.
        assert check_times(node) == [2.0, 4.0, 6.0]
        assert (response.body, response.at) == (b"from b", 8.0)
        assert outcomes(proxy) == [[("a", "unresponsive"), ("b", "completed")]]


async def test_a_check_that_passes_twice_then_is_refused_moves_on_at_the_third_window(
    autojump_clock: trio.abc.Clock,
) -> None:
    node = FakeNode(with_health(frozen()))

    async def refuse_after_two_checks() -> None:
        for _ in range(100):  # 50 s of virtual time at most
            if len(health_checks(node)) >= 2:
                node.refuse = True
                return
            await trio.sleep(0.5)

    async with Fleet({"a": node, "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(refuse_after_two_checks)
                response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert check_times(node) == [2.0, 4.0]
        assert (response.body, response.at) == (b"from b", 6.0)


# -- coalescing and reuse -------------------------------------------------------------------


async def test_one_check_serves_fifty_attempts_waiting_on_a_frozen_node(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet)
        answers: list[tuple[float, bytes]] = []

        async def one() -> None:
            response = await request(proxy, body=UNSTREAMED)
            assert response is not None
            answers.append((response.at, response.body))

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(one)
        assert answers == [(4.0, b"from b")] * 50
        assert check_times(fleet["a"]) == [2.0]  # one GET /health for all 50
        assert fleet["a"].connections == 51  # 50 requests and the one check


async def test_one_check_per_window_serves_fifty_attempts_at_a_slow_live_node(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(slow_prefill(5.0, b"whole")), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        answers: list[tuple[float, bytes, str | None]] = []

        async def one() -> None:
            response = await request(proxy, body=UNSTREAMED)
            assert response is not None
            answers.append((response.at, response.body, response.header("x-failover-attempts")))

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(one)
        assert answers == [(5.0, b"whole", "1")] * 50
        assert check_times(fleet["a"]) == [2.0, 4.0]  # exactly one per window
        assert fleet["b"].received == []


async def test_a_check_that_passed_less_than_a_second_ago_is_reused(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(slow_prefill(5.0, b"whole"))}) as fleet:
        proxy = make_proxy(fleet)
        answers: list[float] = []

        async def one(delay: float) -> None:
            await trio.sleep(delay)
            response = await request(proxy, body=UNSTREAMED)
            assert response is not None
            answers.append(response.at)

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0.0)
                nursery.start_soon(one, 0.5)  # windows end at 2.5 and 4.5: the passes reused
                nursery.start_soon(one, 1.0)  # ends at 3.0: 1 s after the pass, asked again
        assert check_times(fleet["a"]) == [2.0, 3.0, 4.0, 5.0]
        assert sorted(answers) == [5.0, 5.5, 6.0]


# -- hangs, client leaving ------------------------------------------------------------------


async def test_a_check_outlives_the_client_that_asked_and_answers_for_the_node(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The check runs in the proxy's own nursery: bounded, and its verdict is the node's."""
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            gone = await request(proxy, body=UNSTREAMED, leave_after=3.0)  # check runs 2..4
            assert gone is None
            await trio.sleep(10.0)
        node = fleet["a"]
        assert check_times(node)[0] == 2.0
        assert node.closed_at[:2] == [3.0, 4.0]  # the request's at once, the check's at its end
        assert fleet["b"].received == []
        assert status_of(proxy, "a")["last_check"]["ok"] is False
        assert status_of(proxy, "a")["state"] == "down"
        assert outcomes(proxy) == [[("a", "client_abort")]]


async def test_an_attempt_still_waiting_joins_the_check_its_neighbour_asked_for(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet)
        answers: list[float] = []

        async def stays() -> None:
            await trio.sleep(0.5)  # its question at 2.5 comes while the first check runs
            response = await request(proxy, body=UNSTREAMED)
            assert response is not None
            answers.append(response.at)

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stays)
                nursery.start_soon(lambda: request(proxy, body=UNSTREAMED, leave_after=3.0))
        # One check (2..4), whose client left at 3, answers for the node:
        # the one still waiting moves on when it fails.
        assert check_times(fleet["a"]) == [2.0]
        assert answers == [4.0]


async def test_a_check_status_of_503_passes(autojump_clock: trio.abc.Clock) -> None:
    loading = with_health(healthy(b"whole", head_delay=5.0), status=503)
    async with Fleet({"a": FakeNode(loading), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"whole", 5.0)
        assert status_of(proxy, "a")["last_check"] == {
            "kind": "liveness",
            "ok": True,
            "status": 503,
            "error": None,
            "age_s": 1.0,
        }


# -- after the head, first-body-timeout 0 ---------------------------------------------------


async def test_a_stream_whose_node_froze_after_the_head_moves_on_after_a_failed_check(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen_after_head()), "b": FakeNode(healthy(b"b"))}) as fleet:
        proxy = make_proxy(fleet)  # first_body_timeout 0, the default
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"b", 4.0)  # not forever
        assert check_times(fleet["a"]) == [2.0]  # a watched wait: each header timeout too
        assert outcomes(proxy) == [[("a", "unresponsive"), ("b", "completed")]]
        assert proxy.recent[0]["attempts"][0]["detail"].startswith("a: first body byte: ")


async def test_a_long_prefill_after_the_head_is_never_cut_while_checks_pass(
    autojump_clock: trio.abc.Clock,
) -> None:
    node = FakeNode(headers_then_silence(7.0, b"late"))  # its web server answers at once
    async with Fleet({"a": node, "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"late", 7.0)
        assert response.header("x-failover-attempts") == "1"
        assert check_times(node) == [2.0, 4.0, 6.0]
        assert fleet["b"].received == []


async def test_no_check_with_a_first_body_timeout(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(frozen_after_head()), "b": FakeNode(healthy(b"b"))}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=5.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.at == 5.0
        assert check_times(fleet["a"]) == []
        assert outcomes(proxy) == [[("a", "first_body_timeout"), ("b", "completed")]]


async def test_a_streamed_head_still_fails_over_at_the_header_timeout_without_a_check(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"b"))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.at == 2.0
        assert check_times(fleet["a"]) == []
        assert outcomes(proxy) == [[("a", "header_timeout"), ("b", "completed")]]


# -- a slow live node keeps the attempt -----------------------------------------------------


async def test_a_slow_live_node_keeps_the_unstreamed_attempt_up_to_its_answer(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_failover.access")
    async with Fleet({"a": FakeNode(slow_prefill(95.0, b"whole")), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"whole", 95.0)
        assert response.header("x-failover-attempts") == "1"
        assert check_times(fleet["a"]) == [10.0 * n for n in range(1, 10)]  # 10 s: both
        assert fleet["b"].received == []
        assert fleet["a"].connections == 10  # the request's and one per check: none pooled
        access = [r for r in caplog.records if r.name == "trio_failover.access"]
        assert [r.fields["checks"] for r in access] == [9]  # type: ignore[attr-defined]


async def test_a_pooled_connection_waits_watched_too(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(slow_prefill(5.0, b"whole")), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            first = await request(proxy, body=UNSTREAMED)
            second = await request(proxy, body=UNSTREAMED)  # on the pooled connection, at 5
        assert first is not None
        assert second is not None
        assert (first.at, second.at) == (5.0, 10.0)
        assert check_times(fleet["a"]) == [2.0, 4.0, 7.0, 9.0]
        assert fleet["a"].connections == 5  # one for both requests, one per check
        assert second.header("x-failover-attempts") == "1"


async def test_a_live_node_keeps_the_attempt_only_up_to_the_unstreamed_timeout(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_failover.access")
    async with Fleet({"a": FakeNode(slow_prefill(700.0)), "b": FakeNode(healthy(b"b"))}) as fleet:
        proxy = make_proxy(
            fleet, response_header_timeout=120.0, liveness_interval=0
        )  # unstreamed: 600 s; 0: asked only at the header timeouts
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"b", 600.0)
        # None at 600: the attempt has had its whole time then.
        assert check_times(fleet["a"]) == [120.0, 240.0, 360.0, 480.0]
        assert outcomes(proxy) == [[("a", "header_timeout"), ("b", "completed")]]
        access = [r for r in caplog.records if r.name == "trio_failover.access"]
        assert [r.fields["checks"] for r in access] == [4]  # type: ignore[attr-defined]


async def test_the_unstreamed_timeout_cuts_a_check_that_runs_past_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"b"))}) as fleet:
        # The check at 120 may take 10 s; the attempt's last moment is 125.
        proxy = make_proxy(
            fleet, response_header_timeout=120.0, unstreamed_timeout=125.0, liveness_interval=0
        )
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"b", 125.0)
        assert check_times(fleet["a"]) == [120.0]
        assert outcomes(proxy) == [[("a", "header_timeout"), ("b", "completed")]]
        assert status_of(proxy, "a")["last_check"] is None  # cut, not answered


# -- the check itself -----------------------------------------------------------------------


async def test_the_check_is_get_health_under_the_base_path_with_the_nodes_headers(
    autojump_clock: trio.abc.Clock,
) -> None:
    node = FakeNode(with_health(frozen(), answers=1))
    upstream = Upstream("a", "http://a.invalid:80/base", headers={"x-api-key": "k-123456"})
    async with Fleet({"a": node, "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, upstreams=[upstream, *fleet.upstreams()[1:]])
        with trio.fail_after(LIMIT):
            await request(proxy, body=UNSTREAMED)
        check = health_checks(node)[0]
        assert check.target == b"/base/health"
        assert check.header("x-api-key") == b"k-123456"
        assert check.header("connection") == b"close"
        assert check.body == b""


async def test_checks_are_events_metrics_status_and_access_fields(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_failover")
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"b"))}) as fleet:
        proxy = make_proxy(fleet)
        with proxy.events.subscribe(0) as events, trio.fail_after(LIMIT):
            await request(proxy, body=UNSTREAMED)
            published = []
            for _ in range(100):
                try:
                    published.append(events.receive.receive_nowait())
                except trio.WouldBlock:
                    break
        checks = [event for event in published if event["type"] == "check"]
        assert checks == [
            {
                "type": "check",
                "node": "a",
                "kind": "liveness",
                "ok": False,
                "status": None,
                "error": "answer: no response head in 2.0s",
                "elapsed_ms": 2000.0,
            }
        ]
        await trio.sleep(0.5)
        assert status_of(proxy, "a")["last_check"] == {
            "kind": "liveness",
            "ok": False,
            "status": None,
            "error": "answer: no response head in 2.0s",
            "age_s": 0.5,  # the check ended at 4
        }
        assert status_of(proxy, "b")["last_check"] is None
        text, _ = proxy.metrics.render()
        assert b'trio_failover_liveness_checks_total{node="a",result="failed"} 1.0' in text
        access = [r for r in caplog.records if r.name == "trio_failover.access"]
        fields = access[-1].fields  # type: ignore[attr-defined]
        assert fields["checks"] == 1
        assert fields["nodes"] == ["a:unresponsive", "b:completed"]
