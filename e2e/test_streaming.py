"""Scenario 1: a streamed chat through the proxy, token by token, byte for byte."""

from __future__ import annotations

import statistics

import pytest
from conftest import Fleet
from harness import Exchange, chat_body, token_times
from report import Report, median_ms

KINDS = ["llama-server", "llama-cpp-python"]
CHAT = "/v1/chat/completions"
ROUNDS = 3


@pytest.mark.parametrize("kind", KINDS)
def test_stream_arrives_token_by_token_and_byte_identical(
    fleet: Fleet, report: Report, kind: str
) -> None:
    engine = fleet.engine(kind)
    # Direct and proxied requests both pass the same tap, so the difference
    # between them is the proxy's alone, and the tap shows what the engine sent.
    tap = fleet.tap(engine)
    proxy = fleet.proxy([("a", tap.url)])
    body = chat_body(40)
    # One unmeasured request first: the engine's first one pays for warming up.
    assert Exchange.post(tap.port, CHAT, body).read_all().status == 200
    direct, proxied = [], []
    for _ in range(ROUNDS):
        direct.append(Exchange.post(tap.port, CHAT, body).read_all())
        proxied.append(Exchange.post(proxy.port, CHAT, body).read_all())

    sent_by_engine = list(tap.bodies())
    for exchange in proxied:
        assert exchange.status == 200, exchange.body_bytes[:300]
        assert exchange.complete
        assert exchange.response_headers["x-failover-node"] == "a"
        assert exchange.body_bytes in sent_by_engine, "the client got bytes the engine did not send"
        assert exchange.events()[-1].data == "[DONE]"
        tokens = [event for event in exchange.events() if event.content()]
        arrivals = {event.at for event in tokens}
        # One read per token or so: a proxy that buffers delivers them in a few reads at the end.
        assert len(arrivals) >= len(tokens) // 2 >= 10, (len(arrivals), len(tokens))
        assert tokens[-1].at - tokens[0].at >= 0.5

    first_direct, gaps_direct = zip(*(token_times(e) for e in direct), strict=True)
    first_proxied, gaps_proxied = zip(*(token_times(e) for e in proxied), strict=True)
    all_direct = [gap for gaps in gaps_direct for gap in gaps]
    all_proxied = [gap for gaps in gaps_proxied for gap in gaps]
    report.record(
        "1 stream",
        kind,
        ttft_direct=median_ms(list(first_direct)),
        ttft_proxied=median_ms(list(first_proxied)),
        ttft_added=round(
            (statistics.median(first_proxied) - statistics.median(first_direct)) * 1000, 1
        ),
        gap_direct=median_ms(all_direct),
        gap_proxied=median_ms(all_proxied),
        tokens=sum(1 for event in proxied[-1].events() if event.content()),
    )
