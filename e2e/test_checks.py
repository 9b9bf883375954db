"""Scenario 7: the discovery checks do no harm to a running generation (issue 27).

llama-cpp-python, with its default settings (``interrupt_requests`` True),
ends a running stream when any request that needs its model arrives --
``GET /v1/models`` included -- and sends ``[DONE]`` as if the answer were
complete. A check every 2 s during a one-minute stream must not do that:
the proxied stream has as many chunks as the same request made directly,
and ends with ``finish_reason`` ``length``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from conftest import Fleet
from harness import CONTEXT, Exchange, Proxy, chat_body, seconds_per_token, tokens_lasting
from report import Report

CHAT = "/v1/chat/completions"
TARGET_S = 60.0  # how long the stream should last, at the engine's measured speed
INTERVAL = "2s"
# Checks that must find the stream running: ten seconds of it. The stream
# is sized for 60 s; where the context binds (3,900 tokens, some 27 s at
# 150 tokens/s) it still lasts for a dozen.
MIN_CHECKS = 5
WAITED = ("inventory_waits", "ok_inventory_waits")  # results of a check that found it running


def finish_reason(exchange: Exchange) -> Any:
    """The last ``finish_reason`` of a streamed chat (None: none came)."""
    reasons = [
        (json.loads(event.data).get("choices") or [{}])[0].get("finish_reason")
        for event in exchange.events()
        if event.data != "[DONE]"
    ]
    return next((reason for reason in reversed(reasons) if reason), None)


def checks_that_waited(proxy: Proxy) -> float:
    """Checks of node a that asked /health alone, a request being in flight there."""
    return sum(
        proxy.metric("trio_failover_health_checks_total", node="a", result=result)
        for result in WAITED
    )


def test_a_minute_long_stream_is_not_cut_by_checks_every_2_s(fleet: Fleet, report: Report) -> None:
    engine = fleet.engine("llama-cpp-python", interrupt_requests=None)
    assert not any("interrupt_requests" in arg for arg in engine.argv), engine.argv
    # Measured and run directly before the proxy exists: its checks would
    # interrupt a direct stream as well.
    per_token = seconds_per_token(engine.port)
    max_tokens = tokens_lasting(TARGET_S, per_token, CONTEXT - 200)
    body = chat_body(max_tokens)
    direct = Exchange.post(engine.port, CHAT, body, timeout=TARGET_S * 4).read_all()
    assert direct.status == 200, direct.body_bytes[:300]
    assert finish_reason(direct) == "length"
    direct_chunks = sum(1 for event in direct.events() if event.content())

    proxy = fleet.proxy([("a", engine.url)], "--discovery-interval", INTERVAL)
    checks_before = checks_that_waited(proxy)
    started = time.monotonic()
    proxied = Exchange.post(proxy.port, CHAT, body, timeout=TARGET_S * 4)
    proxied.read_head()
    mid_stream: dict[str, Any] = {}
    received = 0
    while (piece := proxied.read_chunk()) is not None:
        received += len(piece)
        if not mid_stream and received > len(direct.body_bytes) / 2:
            mid_stream = proxy.node("a")  # checks ran meanwhile, /health alone
    proxied.close()
    took = time.monotonic() - started
    checks = checks_that_waited(proxy) - checks_before
    proxied_chunks = sum(1 for event in proxied.events() if event.content())
    report.record(
        "7 stream of ~60 s, checks every 2 s",
        "llama-cpp-python (interrupt_requests default)",
        max_tokens=max_tokens,
        chunks_direct=direct_chunks,
        chunks_proxied=proxied_chunks,
        finish_reason=finish_reason(proxied),
        proxied_s=round(took, 1),
        checks_during=round(checks),
    )
    assert proxied.status == 200, proxied.body_bytes[:300]
    assert proxied.complete
    assert proxied.events()[-1].data == "[DONE]"
    assert finish_reason(proxied) == "length"
    assert proxied_chunks == direct_chunks
    assert proxied.body_bytes.count(b"data: ") == direct.body_bytes.count(b"data: ")
    # The checks were at work while it ran: the proxy's count, not the clock's.
    assert checks >= MIN_CHECKS, (checks, took, max_tokens, per_token)
    assert mid_stream["last_outcome"] == "check_inventory_waits", mid_stream
    assert mid_stream["state"] == "ready"
