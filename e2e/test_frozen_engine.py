"""Scenario 11: a frozen engine with the defaults, before and after commit (issue 40).

Two llama-servers and a proxy given no flags at all. A stream runs on ``a``;
then ``a`` is stopped with SIGSTOP (its kernel still accepts connections,
its process answers nothing, ``GET /health`` included: a hung driver, a
swapped-out host, a wedged engine), and a streamed chat and an unstreamed
one are sent, both to ``a`` first (the ranking's first node, with free
slots). With the defaults, every ``--liveness-interval`` (10 s) of a node's
silence towards an attempt asks it ``GET /health``, and no answer within
min(10 s, ``--response-header-timeout``) marks it down: the two waiting
requests go to ``b``, the silent stream is cut, all within 25 s -- not the
120 s of the header timeout, nor the 5 minutes of ``--stream-idle-timeout``.
After SIGCONT, the re-checks of a down node (1, 2, 4, 8 s ... apart) find
``a`` answering and it serves again.

The engines run ``--parallel 3``: the proxy reads the slot count
(capacity ``auto``) and would send a request to ``b`` at once, not to the
frozen ``a``, if ``a`` had no free slot besides the running stream's.
docs/failover.md's timeline 6 and docs/reliability.md quote the figures.
"""

from __future__ import annotations

import signal
import time

from conftest import Fleet
from harness import Exchange, chat_body, read_in_threads, request_id, wait_for
from report import Report

CHAT = "/v1/chat/completions"
# The promise: one interval of silence (10 s), one check's wait for its
# head (10 s), and the next node's short answer. No lower bound: a faster
# machine only makes the answers come sooner.
PROMISE_S = 25.0
# After SIGCONT: a re-check of the down node is never further away than
# the backoff's step (1, 2, 4, 8 s ...) plus a check in flight, which the
# woken engine answers at once.
BACK_BOUND_S = 20.0
# Far more than the stream makes before the freeze, on any machine: a
# frozen engine makes none, and the proxy cuts it long before its end.
STREAM_TOKENS = 3000
READ_LIMIT_S = 60.0


def test_a_frozen_engine_with_the_defaults_costs_one_interval_and_a_check(
    fleet: Fleet, report: Report
) -> None:
    a, b = fleet.engines("llama-server", "a", "b", parallel=3)
    proxy = fleet.proxy([("a", a.url), ("b", b.url)])
    proxy.wait_auto_capacity(("a", "b"), 3)

    stream_id, streamed_id, unstreamed_id = request_id(), request_id(), request_id()
    stream = Exchange.post(
        proxy.port, CHAT, chat_body(STREAM_TOKENS), rid=stream_id, timeout=READ_LIMIT_S
    )
    assert stream.read_head() == 200
    assert stream.response_headers["x-failover-node"] == "a"
    assert len([e for e in stream.read_events(5) if e.content()]) >= 5

    a.signal(signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        streamed = Exchange.post(
            proxy.port, CHAT, chat_body(8), rid=streamed_id, timeout=READ_LIMIT_S
        )
        unstreamed = Exchange.post(
            proxy.port, CHAT, chat_body(8, stream=False), rid=unstreamed_id, timeout=READ_LIMIT_S
        )
        read_in_threads([stream, streamed, unstreamed])()
        cut_after = stream.started + stream.ended_at - frozen
        down = proxy.node("a")

        a.signal(signal.SIGCONT)
        resumed = time.monotonic()
        wait_for(
            lambda: proxy.node("a")["state"] == "ready", BACK_BOUND_S, what="a ready after SIGCONT"
        )
        back_after = time.monotonic() - resumed
    finally:
        a.signal(signal.SIGCONT)

    # The stream of the frozen engine: cut, no clean end, never replayed.
    assert stream.truncated, "the client saw a clean end of a stream whose engine froze"
    assert not stream.complete
    assert all(event.data != "[DONE]" for event in stream.events())
    assert cut_after < PROMISE_S, cut_after
    assert [(x["node"], x["outcome"]) for x in proxy.workload(stream_id)["attempts"]] == [
        ("a", "unresponsive")
    ]
    # The two waiting requests: answered by b, their first attempt at a
    # ended by the unanswered check.
    for exchange, rid in ((streamed, streamed_id), (unstreamed, unstreamed_id)):
        assert exchange.status == 200, exchange.body_bytes[:300]
        assert exchange.complete
        assert exchange.response_headers["x-failover-node"] == "b"
        assert exchange.response_headers["x-failover-attempts"] == "2"
        assert exchange.ended_at < PROMISE_S, (rid, exchange.ended_at)
        attempts = proxy.workload(rid)["attempts"]
        assert [(x["node"], x["outcome"]) for x in attempts] == [
            ("a", "unresponsive"),
            ("b", "completed"),
        ], attempts
    assert streamed.events()[-1].data == "[DONE]"
    assert unstreamed.json()["choices"][0]["message"]["content"]
    assert (down["state"], down["reason"]) == ("down", "unresponsive"), down
    assert down["last_check"]["kind"] == "liveness"
    assert down["last_check"]["ok"] is False

    # Back: a serves again.
    again = Exchange.post(proxy.port, CHAT, chat_body(8), timeout=READ_LIMIT_S).read_all()
    assert again.status == 200, again.body_bytes[:300]
    assert again.complete
    assert again.response_headers["x-failover-node"] == "a"
    assert again.response_headers["x-failover-attempts"] == "1"

    figures = {
        "streamed_answered_by_b": round(streamed.ended_at * 1000),
        "unstreamed_answered_by_b": round(unstreamed.ended_at * 1000),
        "stream_cut_after_freeze": round(cut_after * 1000),
        "ready_after_sigcont": round(back_after * 1000),
    }
    print(figures)
    report.record(
        "11 frozen engine (SIGSTOP), the defaults: two waiting requests, one stream",
        "llama-server",
        **figures,
    )
