"""Scenarios 3 and 4: a frozen node costs one deadline, a dead one is never replayed."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import Fleet
from harness import Exchange, chat_body, token_times, wait_for
from report import Report

KINDS = ["llama-server", "llama-cpp-python"]
CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S = 3.0


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_node_costs_one_header_deadline(fleet: Fleet, report: Report, kind: str) -> None:
    a, b = fleet.engines(kind, "a", "b")
    proxy = fleet.proxy(
        [("a", a.url), ("b", b.url)], "--response-header-timeout", f"{HEADER_TIMEOUT_S:g}s"
    )
    a.signal(signal.SIGSTOP)  # the kernel still accepts its connections: a frozen node

    first = Exchange.post(proxy.port, CHAT, chat_body(8)).read_all()
    assert first.status == 200
    assert first.complete
    assert first.response_headers["x-failover-node"] == "b"
    assert first.response_headers["x-failover-attempts"] == "2"
    failover_ttft, _ = token_times(first)
    assert HEADER_TIMEOUT_S <= first.head_at < HEADER_TIMEOUT_S + 5
    cooling = proxy.node("a")
    assert cooling["state"] == "cooling", cooling

    # The next goes straight to the healthy engine: no second deadline.
    second = Exchange.post(proxy.port, CHAT, chat_body(8)).read_all()
    assert second.status == 200
    assert second.response_headers["x-failover-node"] == "b"
    assert second.response_headers["x-failover-attempts"] == "1"
    assert second.head_at < HEADER_TIMEOUT_S
    direct_ttft, _ = token_times(second)

    a.signal(signal.SIGCONT)
    resumed = time.monotonic()
    wait_for(
        lambda: proxy.node("a")["state"] == "ready",
        HEADER_TIMEOUT_S + 5,
        what="a's cooldown to end",
    )
    restored = time.monotonic() - resumed
    # A new conversation (cache affinity would send the first prompt again
    # to b, which holds it): the resolved order puts a first again.
    fresh = chat_body(8, prompt="Tell me a short story about a harbour pilot.")
    third = Exchange.post(proxy.port, CHAT, fresh).read_all()
    assert third.status == 200
    assert third.complete
    assert third.response_headers["x-failover-node"] == "a"
    assert third.response_headers["x-failover-attempts"] == "1"
    report.record(
        "3 frozen node (SIGSTOP), header deadline 3 s",
        kind,
        failover_ttft=round(failover_ttft * 1000),
        next_ttft=round(direct_ttft * 1000),
        ready_after_sigcont=round(restored * 1000),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_killed_node_truncates_the_stream_and_is_not_replayed(
    fleet: Fleet, report: Report, kind: str
) -> None:
    a, b = fleet.engines(kind, "a", "b")
    tap_b = fleet.tap(b)  # to see every byte that b is sent
    proxy = fleet.proxy([("a", a.url), ("b", tap_b.url)])

    stream = Exchange.post(proxy.port, CHAT, chat_body(400))
    assert stream.read_head() == 200
    assert stream.response_headers["x-failover-node"] == "a"
    assert len([e for e in stream.read_events(5) if e.content()]) >= 5
    killed = time.monotonic()
    a.signal(signal.SIGKILL)
    stream.read_all()
    ended = time.monotonic() - killed

    assert stream.truncated, "the client saw a clean end of a stream whose engine died"
    assert not stream.complete
    assert all(event.data != "[DONE]" for event in stream.events())
    assert ended < 5.0
    # Give a replay, if there were one, the time to reach b.
    time.sleep(1.0)
    assert not tap_b.saw(b"POST "), "the committed request was replayed on b"
    report.record(
        "4 node killed (SIGKILL) mid-stream",
        kind,
        client_saw_end_after=round(ended * 1000),
        tokens_before=len([e for e in stream.events() if e.content()]),
        replayed="no",
    )
