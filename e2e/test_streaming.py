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


def arrivals(exchange: Exchange) -> set[float]:
    """The distinct reads that brought the tokens."""
    return {event.at for event in exchange.events() if event.content()}


def span(exchange: Exchange) -> float:
    """Seconds from the first token's read to the last one's."""
    tokens = [event.at for event in exchange.events() if event.content()]
    return tokens[-1] - tokens[0]


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
    # The engine's own pace, read through the same tap: how many reads its
    # tokens took and over how long, whatever the machine's speed.
    direct_reads = statistics.median(len(arrivals(e)) for e in direct)
    direct_span = statistics.median(span(e) for e in direct)
    for exchange in proxied:
        assert exchange.status == 200, exchange.body_bytes[:300]
        assert exchange.complete
        assert exchange.response_headers["x-failover-node"] == "a"
        assert exchange.body_bytes in sent_by_engine, "the client got bytes the engine did not send"
        assert exchange.events()[-1].data == "[DONE]"
        # One read per token or so, spread as the engine spread them: a proxy
        # that buffers delivers them in a few reads at the end.
        assert len(arrivals(exchange)) >= direct_reads / 2 >= 10, (arrivals(exchange), direct_reads)
        assert span(exchange) >= direct_span / 2, (span(exchange), direct_span)

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
