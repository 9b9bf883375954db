"""Liveness checks on real engines: a stopped engine is left, a slow one is kept.

A request answered whole (``"stream": false``, the OpenAI SDKs' default)
gets its head only with the whole answer. The proxy asks a node that keeps
it waiting for a response-header timeout ``GET /health`` on a connection of
its own: a SIGSTOPped llama-server answers nothing (its kernel still
accepts), so the request moves on after the header timeout plus one check;
a llama-server busy generating answers at once, so it keeps the request to
its end, however long.
"""

from __future__ import annotations

import signal
import time

from conftest import Fleet
from harness import Exchange, chat_body, seconds_per_token, tokens_lasting
from report import Report

CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S = 3.0
CHECK_TIMEOUT_S = min(10.0, HEADER_TIMEOUT_S)
# The long answer lasts about this many header timeouts at the engine's
# measured speed, and must have passed at least MIN_CHECKS checks: room for
# a machine whose speed doubles between the measure and the answer.
LONG_ANSWER_WINDOWS = 12
MIN_CHECKS = 5
# Room for the answer on a machine three times as fast as the 50 tokens/s
# of the test's first machine (36 s at 150 tokens/s: 5,400 tokens).
LONG_CONTEXT = 16384


def test_a_stopped_engine_costs_one_header_timeout_and_a_check_for_an_unstreamed_chat(
    fleet: Fleet, report: Report
) -> None:
    (a,) = fleet.engines("llama-server", "a")
    (b,) = fleet.engines("llama-cpp-python", "b")
    proxy = fleet.proxy(
        [("a", a.url), ("b", b.url)], "--response-header-timeout", f"{HEADER_TIMEOUT_S:g}s"
    )
    a.signal(signal.SIGSTOP)  # idle; its kernel still accepts connections
    try:
        answer = Exchange.post(proxy.port, CHAT, chat_body(8, stream=False), timeout=120).read_all()
        assert answer.status == 200, answer.body_bytes[:300]
        assert answer.complete
        assert answer.response_headers["x-failover-node"] == "b"
        assert answer.response_headers["x-failover-attempts"] == "2"
        assert answer.json()["choices"][0]["message"]["content"]
        moved_on = HEADER_TIMEOUT_S + CHECK_TIMEOUT_S
        # Served by b within the header timeout plus one check, plus b's own
        # generation of 8 tokens (seconds on one CPU thread): not 10 minutes.
        assert moved_on <= answer.head_at < moved_on + 30, answer.head_at
        node = proxy.node("a")
        assert (node["state"], node["reason"]) == ("down", "unresponsive"), node
        assert node["last_check"]["kind"] == "liveness"
        assert node["last_check"]["ok"] is False
        assert node["last_check"]["status"] is None
        attempts = proxy.status()["workloads"][-1]["attempts"]
        assert [(x["node"], x["outcome"]) for x in attempts] == [
            ("a", "unresponsive"),
            ("b", "completed"),
        ]
        unresponsive_ms = attempts[0]["elapsed_ms"]
        assert moved_on * 1000 <= unresponsive_ms < moved_on * 1000 + 1000
    finally:
        a.signal(signal.SIGCONT)
    report.record(
        "27 stopped engine (SIGSTOP), unstreamed chat, header deadline 3 s",
        "llama-server -> llama-cpp-python",
        left_a_after=round(unresponsive_ms),
        answered_by_b=round(answer.head_at * 1000),
    )


def test_a_long_unstreamed_answer_at_a_live_engine_is_kept_with_one_attempt(
    fleet: Fleet, report: Report
) -> None:
    a, b = fleet.engines("llama-server", "a", "b", ctx_size=LONG_CONTEXT)
    # The answer's length from a's speed here and now, measured before the
    # proxy exists: some LONG_ANSWER_WINDOWS header timeouts of generation,
    # on a machine three times faster or slower alike. The end tokens are
    # forbidden (chat_body's logit_bias), ignore_eos too.
    per_token = seconds_per_token(a.port)
    max_tokens = tokens_lasting(
        LONG_ANSWER_WINDOWS * HEADER_TIMEOUT_S, per_token, LONG_CONTEXT - 64
    )
    # --unstreamed-timeout well above the answer: it alone may end a live
    # node's attempt.
    proxy = fleet.proxy(
        [("a", a.url), ("b", b.url)],
        "--response-header-timeout",
        f"{HEADER_TIMEOUT_S:g}s",
        "--unstreamed-timeout",
        "30m",
    )
    body = chat_body(max_tokens, stream=False, prompt="Count from one upwards, in words.")
    body["ignore_eos"] = True
    started = time.monotonic()
    answer = Exchange.post(proxy.port, CHAT, body, timeout=1500).read_all()
    took = time.monotonic() - started
    assert answer.status == 200, answer.body_bytes[:300]
    assert answer.complete
    assert answer.response_headers["x-failover-node"] == "a"
    assert answer.response_headers["x-failover-attempts"] == "1"
    assert answer.json()["usage"]["completion_tokens"] == max_tokens
    checks = proxy.last_request_checks()
    # What the test is about: the head came only with the answer, after
    # many windows of silence, each ended by a check that passed, and the
    # node kept the request. Planned for LONG_ANSWER_WINDOWS windows, so a
    # machine twice as fast during the answer as during the probe still
    # gives MIN_CHECKS.
    assert checks >= MIN_CHECKS, (checks, took, max_tokens, per_token)
    # The proxy's own timers, not the engine's speed: the checks fall at
    # whole windows of silence (the k-th at k * 3 s), all before the head.
    assert answer.head_at >= checks * HEADER_TIMEOUT_S, (answer.head_at, checks)
    # And no window went unchecked: one check per window of 3 s, give or
    # take the last one's.
    assert checks >= int(took / (HEADER_TIMEOUT_S + 0.5)) - 1, (checks, took)
    node = proxy.node("a")
    assert node["state"] == "ready", node
    assert node["last_check"]["ok"] is True, node
    # The last check may be discovery's (kind "health", which keeps no
    # status) when one fell after the answer's last liveness question.
    if node["last_check"]["kind"] == "liveness":
        assert node["last_check"]["status"] == 200, node
    assert proxy.node("b")["served"] == 0
    workload = proxy.status()["workloads"][-1]
    assert [(x["node"], x["outcome"]) for x in workload["attempts"]] == [("a", "completed")]
    report.record(
        "27 long unstreamed answer at a live engine, header deadline 3 s",
        "llama-server",
        answer_s=round(took, 1),
        completion_tokens=max_tokens,
        per_token_ms=round(per_token * 1000, 1),
        liveness_checks=checks,
        attempts=1,
    )
