"""Deadlines, the commit point and the cooldown, checked in virtual time.

Every test runs the whole proxy over in-memory streams under
``MockClock(autojump_threshold=0)`` (pytest-trio's ``autojump_clock``), so a
120-second deadline costs milliseconds and the asserted times are exact.
"""

from __future__ import annotations

import json

import attrs
import pytest
import trio

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    FakeNode,
    Fleet,
    die_mid_stream,
    drop_before_body,
    frozen,
    headers_then_silence,
    healthy,
    partial_head_then_stall,
    request,
    retry_status,
    stream_then_silence,
)

# Streamed: the response-header timeout bounds the wait for its head (an
# unstreamed request would wait --unstreamed-timeout).
BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi " * 50}]}
).encode()


def make_proxy(fleet: Fleet, **settings: object) -> Proxy:
    # These tests time the deadlines themselves: no liveness questions between
    # them (--liveness-interval 0; tests/test_frozen_node.py has the questions).
    settings.setdefault("liveness_interval", 0)
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


def outcomes(proxy: Proxy) -> list[list[tuple[str, str]]]:
    """(node, outcome) per attempt, per finished workload."""
    return [[(a["node"], a["outcome"]) for a in w["attempts"]] for w in proxy.recent]


async def test_frozen_node_costs_one_deadline_then_cools_down(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet)
        first = await request(proxy, body=BODY)
        assert first is not None
        assert (first.status, first.body) == (200, b"ok")
        assert first.at == 120.0
        assert first.header("x-failover-node") == "good"
        assert first.header("x-failover-attempts") == "2"
        assert fleet["good"].received[0].body == BODY
        assert proxy.cooldowns.is_cooling("frozen", trio.current_time())

        second = await request(proxy, body=BODY)
        assert second is not None
        assert second.at == 120.0  # served at once: no second deadline paid
        assert second.header("x-failover-attempts") == "1"
        assert len(fleet["frozen"].received) == 1
        assert [r.body for r in fleet["good"].received] == [BODY, BODY]


async def test_cooldown_expires_after_exactly_one_header_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy())}) as fleet:
        # Cache affinity off: the same prompt, served by "good" while "frozen"
        # cooled, would prefer "good"; this test wants the priority order back.
        proxy = make_proxy(fleet, affinity="off")
        await request(proxy, body=BODY)  # stall at t=0..120, cooldown until 240
        await trio.sleep(120 - 0.001)
        await request(proxy, body=BODY)
        assert len(fleet["frozen"].received) == 1  # still cooling at 239.999
        await trio.sleep(0.001)
        assert trio.current_time() == 240.0
        await request(proxy, body=BODY)
        assert len(fleet["frozen"].received) == 2  # tried first again
        assert proxy.status()["nodes"][0]["state"] == "cooling"  # stalled again


async def test_success_from_a_cooling_node_restores_it_early(
    autojump_clock: trio.abc.Clock,
) -> None:
    node_a = FakeNode(frozen())
    limited = FakeNode(retry_status(429, headers=(("retry-after", "60"),)))
    async with Fleet({"a": node_a, "b": limited}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 429
        assert trio.current_time() == 10.0
        # Both cool until 20 ("a" stalled 0..10, "b" answered at 10 with a
        # Retry-After capped at 10 s), so the next request, at 10, comes well
        # before either cooldown would end by itself. All-cooling candidates
        # stay usable in order; "a" heals, and its success ends its cooldown.
        assert proxy.cooldowns.is_cooling("a", 10.0)
        node_a.behaviour = healthy(b"back")
        healed = await request(proxy, body=BODY)
        assert healed is not None
        assert (healed.body, healed.at) == (b"back", 10.0)
        assert not proxy.cooldowns.is_cooling("a", trio.current_time())
        assert proxy.cooldowns.is_cooling("b", trio.current_time())


async def test_post_head_silence_is_unbounded_by_default(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet(
        {"slow": FakeNode(headers_then_silence(360, b"late")), "peer": FakeNode(healthy())}
    ) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.body, response.at) == (b"late", 360.0)
        assert fleet["peer"].received == []
        assert not proxy.cooldowns.is_cooling("slow", trio.current_time())


async def test_first_body_timeout_opt_in_fails_over_and_cools_for_header_duration(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet(
        {"slow": FakeNode(headers_then_silence(360)), "peer": FakeNode(healthy(b"peer"))}
    ) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=1.0)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.body, response.at) == (b"peer", 1.0)
        cooldown = proxy.cooldowns.get("slow", trio.current_time())
        assert cooldown is not None
        assert cooldown.until == 121.0  # one response-header duration, not one second
        assert cooldown.reason == "first_body_timeout"


async def test_partial_head_then_stall_fails_over_at_the_header_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet(
        {"partial": FakeNode(partial_head_then_stall()), "peer": FakeNode(healthy(b"peer"))}
    ) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.body, response.at) == (b"peer", 120.0)
        assert outcomes(proxy) == [[("partial", "header_timeout"), ("peer", "completed")]]


@pytest.mark.parametrize(
    ("first", "outcome"),
    [
        pytest.param(FakeNode(refuse=True), "connect_failed", id="refused"),
        pytest.param(FakeNode(drop_before_body()), "closed_early", id="drop-before-body"),
        pytest.param(FakeNode(retry_status(503)), "retryable_response", id="503"),
        pytest.param(FakeNode(retry_status(500)), "retryable_response", id="500"),
    ],
)
async def test_fast_failures_fail_over_without_cooldown(
    autojump_clock: trio.abc.Clock, first: FakeNode, outcome: str
) -> None:
    async with Fleet({"bad": first, "peer": FakeNode(healthy(b"peer"))}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.status, response.body, response.at) == (200, b"peer", 0.0)
        assert outcomes(proxy) == [[("bad", outcome), ("peer", "completed")]]
        assert proxy.cooldowns.active(trio.current_time()) == []
        assert fleet["peer"].received[0].body == BODY


async def test_reset_before_head_fails_over_without_cooldown(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def reset(io: object, request: object) -> None:
        stream = io.stream  # type: ignore[attr-defined]
        await trio.aclose_forcefully(stream)

    async with Fleet({"bad": FakeNode(reset), "peer": FakeNode(healthy(b"peer"))}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.body == b"peer"
        assert outcomes(proxy)[0][0] == ("bad", "closed_early")
        assert proxy.cooldowns.active(trio.current_time()) == []


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param((("retry-after", "7"),), id="seconds"),
        # The node's clock is years off the proxy's; only the difference counts.
        pytest.param(
            (
                ("date", "Sun, 06 Nov 1994 08:49:30 GMT"),
                ("retry-after", "Sun, 06 Nov 1994 08:49:37 GMT"),
            ),
            id="date-read-against-the-nodes-date-header",
        ),
    ],
)
async def test_429_retry_after_demotes_for_exactly_that_long(
    autojump_clock: trio.abc.Clock, headers: tuple[tuple[str, str], ...]
) -> None:
    limited = FakeNode(retry_status(429, headers=headers))
    async with Fleet({"limited": limited, "peer": FakeNode(healthy(b"peer"))}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.body == b"peer"
        cooldown = proxy.cooldowns.get("limited", 0.0)
        assert cooldown is not None
        assert (cooldown.since, cooldown.until) == (0.0, 7.0)
        await trio.sleep(6.999)
        assert proxy.status()["nodes"][0]["state"] == "cooling"
        await trio.sleep(0.001)
        assert proxy.status()["nodes"][0]["state"] == "ready"


async def test_retry_after_is_capped_at_one_header_timeout(autojump_clock: trio.abc.Clock) -> None:
    limited = FakeNode(retry_status(429, headers=(("retry-after", "100000"),)))
    async with Fleet({"limited": limited, "peer": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet)
        await request(proxy, body=BODY)
        cooldown = proxy.cooldowns.get("limited", 0.0)
        assert cooldown is not None
        assert cooldown.until == 120.0


async def test_lone_rate_limited_node_passes_its_429_through(
    autojump_clock: trio.abc.Clock,
) -> None:
    body = b'{"error": {"message": "slow down", "code": "rate_limited"}}'
    node = FakeNode(retry_status(429, body, headers=(("retry-after", "7"), ("x-vendor", "v"))))
    async with Fleet({"only": node}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.status, response.body) == (429, body)
        assert response.header("retry-after") == "7"
        assert response.header("x-vendor") == "v"
        assert response.header("x-failover-node") == "only"


async def test_context_length_error_fails_over_but_plain_400_is_relayed(
    autojump_clock: trio.abc.Clock,
) -> None:
    too_long = b'{"error": {"message": "too long", "code": "context_length_exceeded"}}'
    plain = b'{"error": {"message": "bad field", "code": "invalid_value"}}'
    async with Fleet(
        {"small": FakeNode(retry_status(400, too_long)), "big": FakeNode(healthy(b"big"))}
    ) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.status, response.body) == (200, b"big")
    async with Fleet(
        {"small": FakeNode(retry_status(400, plain)), "big": FakeNode(healthy(b"big"))}
    ) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.status, response.body) == (400, plain)
        assert fleet["big"].received == []


async def test_all_failed_with_a_timeout_is_504_with_attempts(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(refuse=True), "b": FakeNode(frozen())}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=5.0)
        response = await request(proxy, body=BODY, headers=[("x-request-id", "req-42")])
        assert response is not None
        assert response.status == 504
        document = response.json()
        assert document.keys() == {"error", "attempts"}  # the attempts once, at the top
        assert document["error"] == {
            "message": document["error"]["message"],
            "type": "upstream_error",
            "code": "upstream_timeout",
        }
        assert [(a["node"], a["outcome"]) for a in document["attempts"]] == [
            ("a", "connect_failed"),
            ("b", "header_timeout"),
        ]
        assert document["attempts"][1]["elapsed_ms"] == 5000.0
        assert response.header("x-request-id") == "req-42"


async def test_all_refused_is_502(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(refuse=True), "b": FakeNode(refuse=True)}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 502
        assert response.json()["error"]["type"] == "upstream_error"


async def test_max_attempts_limits_the_candidates(autojump_clock: trio.abc.Clock) -> None:
    nodes = {"a": FakeNode(refuse=True), "b": FakeNode(refuse=True), "c": FakeNode(healthy())}
    async with Fleet(nodes) as fleet:
        proxy = make_proxy(fleet, max_attempts=2)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 502
        assert fleet["c"].received == []


async def test_committed_stream_then_upstream_death_truncates(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet(
        {"dies": FakeNode(die_mid_stream(3)), "peer": FakeNode(healthy(b"peer"))}
    ) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 200
        assert not response.complete  # no terminating chunk: the client sees an error
        assert response.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert fleet["peer"].received == []  # never replayed after commit
        assert outcomes(proxy) == [[("dies", "stream_broken")]]


async def test_stream_idle_timeout_aborts_and_cools(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"quiet": FakeNode(stream_then_silence(2, 600)), "peer": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert not response.complete
        assert response.at == 300.0  # commit at 0 + five minutes of silence
        assert proxy.cooldowns.is_cooling("quiet", trio.current_time())
        assert fleet["peer"].received == []


async def test_stream_idle_timeout_zero_waits(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"quiet": FakeNode(stream_then_silence(2, 600)), "peer": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, stream_idle_timeout=0)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.complete
        assert response.at == 600.0
        assert response.body.endswith(b"data: [DONE]\n\n")


async def test_empty_bodies_commit(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"empty": FakeNode(healthy(b"", status=204)), "peer": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=1.0)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.status, response.body, response.complete) == (204, b"", True)
        assert fleet["peer"].received == []


async def test_one_workload_id_on_every_attempt(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(retry_status(503)), "b": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        sent = response.header("x-request-id")
        assert sent
        seen = [r.header("x-request-id") for r in (*fleet["a"].received, *fleet["b"].received)]
        assert seen == [sent.encode(), sent.encode()]


async def test_manual_selection_never_lifts_a_cooling_node(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy(b"a")), "b": FakeNode(frozen())}) as fleet:
        proxy = make_proxy(fleet)
        chosen = await request(proxy, body=BODY, headers=[("x-failover-node", "b")])
        assert chosen is not None
        assert chosen.body == b"a"  # b stalled, a served at t=120
        again = await request(proxy, body=BODY, headers=[("x-failover-node", "b")])
        assert again is not None
        assert again.body == b"a"
        assert len(fleet["b"].received) == 1  # cooling b was not lifted above ready a


async def test_model_mapping_rewrites_only_that_nodes_body(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(retry_status(503)), "b": FakeNode(healthy())}) as fleet:
        a, b = fleet.upstreams()
        config = Config(upstreams=[a, attrs.evolve(b, models={"*": "other"})], admin_listen=None)
        proxy = Proxy(config, connector=fleet.connector)
        await request(proxy, body=BODY)
        assert fleet["a"].received[0].body == BODY
        rewritten = fleet["b"].received[0].json()
        assert rewritten["model"] == "other"
        assert rewritten["messages"] == json.loads(BODY)["messages"]


async def test_no_node_serves_the_model_is_404(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        (a,) = fleet.upstreams()
        config = Config(upstreams=[attrs.evolve(a, models=["other"])], admin_listen=None)
        proxy = Proxy(config, connector=fleet.connector)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 404
        assert response.json()["error"]["code"] == "model_not_found"


async def test_a_retryable_answer_too_long_to_hold_is_never_relayed_cut(
    autojump_clock: trio.abc.Clock,
) -> None:
    huge = b'{"error": {"message": "' + b"x" * 100_000 + b'"}}'
    async with Fleet({"only": FakeNode(retry_status(503, huge))}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        # Held whole, the 503 would be relayed; cut at 64 KiB it would pass
        # for a complete answer. The proxy answers for itself instead.
        assert response.status == 502
        assert response.json()["attempts"][0]["status"] == 503


async def test_the_proxy_executes_the_verdict_of_judge(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether to move on is outcome.judge's decision, not the loop's: a
    # verdict without fail_over ends the workload at that attempt.
    from trio_failover.core import outcome
    from trio_failover.proxy.request import milestones as proxy_module

    def no_failover(*args: object, **kwargs: object) -> outcome.Verdict:
        return outcome.Verdict(fail_over=False, cooldown=0.0, timed_out=False)

    monkeypatch.setattr(proxy_module, "judge", no_failover)
    async with Fleet({"bad": FakeNode(refuse=True), "peer": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 502
        assert fleet["peer"].received == []


async def test_a_cooldown_that_ends_during_an_attempt_counts_at_the_next(
    autojump_clock: trio.abc.Clock,
) -> None:
    # "b" cools until t=5; the attempt on "a" stalls until t=10. The second
    # attempt must judge readiness at t=10 (b ready again, and before c in
    # the ranking), not at the workload's start (b still cooling).
    nodes = {"a": FakeNode(frozen()), "b": FakeNode(healthy(b"b")), "c": FakeNode(healthy(b"c"))}
    async with Fleet(nodes) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        proxy.board.demote("b", 5.0, "header_timeout", trio.current_time())
        response = await request(proxy, body=BODY)
        assert response is not None
        assert (response.status, response.at) == (200, 10.0)
        assert response.header("x-failover-node") == "b"
        assert outcomes(proxy) == [[("a", "header_timeout"), ("b", "completed")]]
