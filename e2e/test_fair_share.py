"""Fair share on real engines: a flood of one client does not make another wait behind it.

Two llama-servers (``--parallel 2``: four slots), two client keys. Alice
puts three rounds of streams into the fleet at once: four run, eight wait
in the proxy's queue. Then Bob sends three streams, one after another.
With fair share (the default) each of Bob's takes the next slot that
frees, ahead of Alice's backlog, so his first token comes within about one
of Alice's streams; first come, first served would have made him wait
for two rounds of hers. The streams are sized from the engines' speed
measured first in the same test; the bound is a ratio of the durations
measured here, never a number of seconds.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

from conftest import Fleet
from harness import Exchange, chat_body, request_id, wait_for
from report import Report

CHAT = "/v1/chat/completions"
KEYS = {"alice": "ka-fair-5d0e7b21c9a4", "bob": "kb-fair-9a3f61d8e2c7"}
FLOOD = 12  # three rounds of the fleet's four slots
STREAM_SECONDS = 2.0  # what one stream should last on this machine, unloaded


def send(port: int, key: str, body: dict[str, Any]) -> Exchange:
    headers = [
        ("content-type", "application/json"),
        ("authorization", f"Bearer {key}"),
        ("x-request-id", request_id()),
    ]
    exchange = Exchange(port, "POST", CHAT, json.dumps(body).encode(), headers, 300.0)
    exchange.send()
    return exchange


def first_token_at(exchange: Exchange) -> float:
    """Seconds from the request to its first event with content."""
    events = exchange.read_events(1)
    content = [event.at for event in events if event.content()]
    assert content, exchange.body_bytes[:300]
    return content[0]


def test_a_flood_of_one_client_costs_another_at_most_the_next_freed_slot(
    fleet: Fleet, report: Report
) -> None:
    engines = fleet.engines("llama-server", "a", "b", parallel=2)
    keys = [arg for name, key in KEYS.items() for arg in ("--api-key", f"{name}={key}")]
    proxy = fleet.proxy([(engine.name, engine.url) for engine in engines], *keys)
    proxy.wait_auto_capacity(("a", "b"), 2)

    # How fast this machine generates: size the streams to about 2 s each.
    probe = send(proxy.port, KEYS["alice"], chat_body(32)).read_all()
    assert probe.status == 200
    assert probe.complete
    generating = probe.ended_at - first_token_at_of(probe)
    max_tokens = max(32, min(2000, int(32 * STREAM_SECONDS / max(generating, 1e-3))))
    body = chat_body(max_tokens)

    flood = [send(proxy.port, KEYS["alice"], body) for _ in range(FLOOD)]
    readers = [threading.Thread(target=exchange.read_all) for exchange in flood]
    for reader in readers:
        reader.start()
    try:
        wait_for(lambda: proxy.status()["queued"] >= FLOOD - 4, 60, what="Alice's backlog")
        bob: list[tuple[float, float]] = []  # (first token, whole stream), seconds
        backlog: list[int] = []  # Alice's requests still waiting as each of Bob's began
        for _ in range(3):
            exchange = send(proxy.port, KEYS["bob"], body)
            first = first_token_at(exchange)
            backlog.append(proxy.status()["queued"])
            exchange.read_all()
            assert exchange.status == 200
            assert exchange.complete
            bob.append((first, exchange.ended_at))
    finally:
        deadline = time.monotonic() + 300
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
    assert all(not reader.is_alive() for reader in readers)
    unfinished = [
        (exchange.status, exchange.truncated, exchange.ended_at, exchange.body_bytes[-200:])
        for exchange in flood
        if not (exchange.status == 200 and exchange.complete)
    ]
    assert not unfinished, unfinished

    # One of Alice's streams, under this load: from its head to its end.
    running = [exchange.ended_at - exchange.head_at for exchange in flood]
    one_stream = max(running)
    for first, _ in bob:
        # The next freed slot comes within one stream (plus Bob's own prefill,
        # a fraction of a stream); behind the backlog it would be two rounds.
        assert first <= 1.5 * one_stream, (bob, one_stream)
    # Bob's first went ahead of Alice's waiting work, not after her flood.
    assert backlog[0] > 0, (bob, backlog)
    report.record(
        "9 fair share: a flood of one client, another's first token",
        "llama-server",
        stream_median_ms=round(statistics.median(running) * 1000),
        stream_longest_ms=round(one_stream * 1000),
        bob_first_token_ms=[round(first * 1000) for first, _ in bob],
        alice_waiting_as_bob_began=backlog,
    )
    print(
        f"\nfair share: Alice's stream {statistics.median(running):.2f} s median, "
        f"{one_stream:.2f} s longest; Bob's first tokens "
        + ", ".join(f"{first:.2f} s" for first, _ in bob)
    )


def first_token_at_of(exchange: Exchange) -> float:
    """Seconds from the request to the first event with content, of an answer read whole."""
    content = [event.at for event in exchange.events() if event.content()]
    assert content
    return content[0]
