"""Scenario 8: what two real llama-servers say of themselves, and no flags (issue 30).

Two ``llama-server --parallel 2`` and a proxy given no ``--capacity``: the
proxy finds each node's engine at its first check, reads ``/props``
(``total_slots`` 2: capacity ``auto``) and ``/slots`` (the busy slots,
whoever sent the work) every load interval, and places each stream where
a slot is free. Without that (issue 30's measurement before it was built)
four streams all went to the first engine, two of them deferred inside it
for 8.3 s before their first token, and with that engine kept busy by
direct requests a proxied stream still went to it and waited 18 to 19 s.

The proxy runs with ``--load-interval 500ms`` so a test need not wait 2 s
for a reading; nothing else is set. Streams are read in threads of their
own, so each one's time to first token is its own. Every wait is bounded
and waits on what the engines and the proxy say (``/slots``, ``/status``).
"""

from __future__ import annotations

from typing import Any

from conftest import Fleet
from harness import (
    CONTEXT,
    Exchange,
    HarnessError,
    Proxy,
    chat_body,
    read_in_threads,
    request_id,
    seconds_per_token,
    token_times,
    tokens_lasting,
    wait_for,
)
from report import Report

CHAT = "/v1/chat/completions"
LOAD_INTERVAL = "500ms"
# Far below the wait of a stream deferred inside an engine (8.3 s in issue
# 30: until another stream ends), far above a first token on the machine the
# suite was written on, under load (under 2 s); on a slower one, four first
# tokens of an idle engine there (``first_token_bound``).
FIRST_TOKEN_BOUND_S = 6.0
FIRST_TOKENS_ALONE = 4


def first_token_bound(port: int) -> float:
    """The first-token time no stream may reach: this machine's floor, or more if it is slow.

    Twice the bound is how long each stream runs alone, at the speed
    measured in the test (two sharing an engine's thread run longer): all
    still run while the test looks at the engines, and a stream deferred
    behind another would wait at least that long for its first token.
    """
    probe = Exchange.post(port, CHAT, chat_body(1, prompt="Probe: one word."), timeout=120)
    first, _ = token_times(probe.read_all())
    return max(FIRST_TOKEN_BOUND_S, FIRST_TOKENS_ALONE * first)


def post_streams(proxy: Proxy, count: int, tokens: int) -> dict[str, Exchange]:
    """``count`` streams through the proxy at once, by their request ids."""
    ids = [request_id() for _ in range(count)]
    return {
        rid: Exchange.post(proxy.port, CHAT, chat_body(tokens), rid=rid, timeout=120) for rid in ids
    }


def nodes_running(proxy: Proxy, ids: list[str]) -> dict[str, str]:
    """The node each of ``ids`` is on, once /status shows every one of them running."""

    def placed() -> dict[str, str] | None:
        nodes = {w["id"]: w["node"] for w in proxy.status()["workloads"] if w["node"]}
        return {rid: nodes[rid] for rid in ids} if all(rid in nodes for rid in ids) else None

    found: dict[str, str] = wait_for(placed, 15, interval=0.05, what=f"{ids} on their nodes")
    return found


def first_token_ms(stream: Exchange) -> int:
    return round(token_times(stream)[0] * 1000)


def check_complete(stream: Exchange) -> None:
    assert stream.status == 200, stream.body_bytes[:300]
    assert stream.complete
    assert stream.events()[-1].data == "[DONE]"


def test_four_streams_two_on_each_engine_none_waiting_inside(fleet: Fleet, report: Report) -> None:
    a, b = fleet.engines("llama-server", "a", "b", parallel=2)
    bound = first_token_bound(a.port)
    stream_tokens = tokens_lasting(2 * bound, seconds_per_token(a.port), CONTEXT - 64)
    proxy = fleet.proxy([("a", a.url), ("b", b.url)], "--load-interval", LOAD_INTERVAL)
    auto_after = proxy.wait_auto_capacity(("a", "b"), 2)

    by_id = post_streams(proxy, 4, stream_tokens)
    streams = list(by_id.values())
    finished = read_in_threads(streams)
    placed = nodes_running(proxy, list(by_id))
    assert sorted(placed.values()) == ["a", "a", "b", "b"], placed
    seen: dict[str, Any] = {}

    def both_full() -> bool:
        seen.update(busy_a=a.busy_slots(), busy_b=b.busy_slots())
        seen.update(deferred_a=a.deferred(), deferred_b=b.deferred())
        seen["queued"] = proxy.status()["queued"]
        return seen["busy_a"] == 2 and seen["busy_b"] == 2

    try:
        wait_for(both_full, 30, interval=0.1, what="two busy slots on each engine")
    except HarnessError as exc:
        raise HarnessError(f"{exc}: last seen {seen}") from None
    # At the moment all four ran: nothing deferred inside an engine, nothing
    # waiting in the proxy's queue.
    assert (seen["deferred_a"], seen["deferred_b"], seen["queued"]) == (0, 0, 0), seen

    for stream in finished():
        check_complete(stream)
    nodes = [stream.response_headers["x-failover-node"] for stream in streams]
    assert nodes == [placed[rid] for rid in by_id], (nodes, placed)
    ttft = [first_token_ms(stream) for stream in streams]
    assert max(ttft) < bound * 1000, list(zip(nodes, ttft, strict=True))
    report.record(
        "8 four streams, two llama-server --parallel 2, no --capacity",
        "llama-server",
        capacity_auto_after_start=auto_after,
        nodes="".join(nodes),
        first_token=ttft,
        first_token_bound_ms=round(bound * 1000),
        stream_tokens=stream_tokens,
    )


def test_engine_kept_busy_directly_sends_proxied_streams_to_the_other(
    fleet: Fleet, report: Report
) -> None:
    a, b = fleet.engines("llama-server", "a", "b", parallel=2)
    bound = first_token_bound(b.port)
    proxy = fleet.proxy([("a", a.url), ("b", b.url)], "--load-interval", LOAD_INTERVAL)
    proxy.wait_auto_capacity(("a", "b"), 2)

    # Two streams straight to a, past the proxy: only a's /slots says so.
    direct = [Exchange.post(a.port, CHAT, chat_body(2000), timeout=120) for _ in "12"]
    for stream in direct:
        assert stream.read_head() == 200
        stream.read_events(1)
    wait_for(lambda: a.busy_slots() == 2, 30, interval=0.1, what="a's two slots busy")

    def proxy_sees_a_busy() -> bool:
        signals = proxy.node("a")["engine_signals"] or {}
        return signals.get("busy") == 2 and not signals.get("stale")

    wait_for(proxy_sees_a_busy, 10, interval=0.1, what="the proxy's reading of a: busy 2")

    by_id = post_streams(proxy, 2, 24)
    streams = list(by_id.values())
    finished = read_in_threads(streams)
    # Where the proxy sent them, before they end: a stream sent to the full
    # a would wait there behind the direct ones, for minutes.
    placed = nodes_running(proxy, list(by_id))
    assert sorted(placed.values()) == ["b", "b"], placed
    for stream in finished():
        check_complete(stream)
    nodes = [stream.response_headers["x-failover-node"] for stream in streams]
    attempts = [stream.response_headers["x-failover-attempts"] for stream in streams]
    assert nodes == ["b", "b"], nodes
    assert attempts == ["1", "1"], attempts
    assert a.busy_slots() == 2, "the direct streams ended early: lengthen them"
    ttft = [first_token_ms(stream) for stream in streams]
    assert max(ttft) < bound * 1000, ttft
    for stream in direct:
        stream.close()
    report.record(
        "8 a kept busy by two direct streams, two proxied streams, no --capacity",
        "llama-server",
        nodes="".join(nodes),
        first_token=ttft,
    )
