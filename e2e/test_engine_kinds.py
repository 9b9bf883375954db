"""Scenario 10: engines as users run them, with the proxy's defaults (issue 40).

- llama-cpp-python with its *default* settings (``interrupt_requests`` on: a
  request that waits for its model ends the running stream with ``[DONE]``
  and no ``finish_reason``). The proxy, given no flags, finds the engine at
  its first check (from the check's own ``GET /v1/models``) and takes
  capacity 1 from its kind: twenty streams sent at once run one after the
  other and every one of them ends with its tokens and ``finish_reason``.
  Without that a user saw 15 of 20 come back ``200`` with ``[DONE]`` and no
  token.
- Two llama-servers whose contexts differ, the smaller one first: a prompt
  longer than its context gets llama-server's own ``400``
  (``exceed_context_size_error``), which the default ``--retry-error-codes``
  (``context_length_exceeded``) now counts, so the request goes on to the
  engine whose context holds it (2 attempts).

Nothing here bounds a duration from below; the upper bounds are generous
(the streams are short, the machine may be slow).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from conftest import Fleet
from harness import Exchange, Proxy, chat_body, long_prompt, request_id, wait_for
from report import Report

CHAT = "/v1/chat/completions"
STREAMS = 20
TOKENS = 8


def wait_detected(proxy: Proxy, name: str) -> dict[str, object]:
    """Until /status shows ``name``'s engine found (whatever kind); that node's status."""

    def found() -> dict[str, object] | None:
        node = proxy.node(name)
        return node if node.get("engine") else None

    node: dict[str, object] = wait_for(found, 15, interval=0.1, what=f"{name}'s engine found")
    return node


def finish_reason(stream: Exchange) -> str | None:
    for event in reversed(stream.events()):
        if event.data != "[DONE]":
            choices = json.loads(event.data).get("choices") or [{}]
            return str(choices[0].get("finish_reason"))
    return None


def test_twenty_streams_to_llama_cpp_python_with_its_defaults_all_complete(
    fleet: Fleet, report: Report
) -> None:
    (engine,) = fleet.engines("llama-cpp-python", "a", interrupt_requests=None)
    proxy = fleet.proxy([("a", engine.url)])  # the proxy's defaults
    # The proxy's first check, within a second of its start, finds the engine.
    node = wait_detected(proxy, "a")
    streams = [
        Exchange.post(proxy.port, CHAT, chat_body(TOKENS), timeout=240) for _ in range(STREAMS)
    ]
    with ThreadPoolExecutor(STREAMS) as pool:
        done = list(pool.map(Exchange.read_all, streams))
    tokens = [sum(1 for event in s.events() if event.content()) for s in done]
    cut = [index for index, s in enumerate(done) if finish_reason(s) != "length"]
    report.record(
        "10 twenty streams, llama-cpp-python defaults",
        "llama-cpp-python",
        streams=STREAMS,
        complete=sum(s.complete for s in done),
        with_all_tokens=sum(count == TOKENS for count in tokens),
        interrupted=len(cut),
        disconnects=engine.disconnects(),  # type: ignore[attr-defined]
    )
    assert [s.status for s in done] == [200] * STREAMS
    assert all(s.complete and s.events()[-1].data == "[DONE]" for s in done)
    assert cut == [], [done[index].body_bytes[-300:] for index in cut]
    assert tokens == [TOKENS] * STREAMS
    assert engine.disconnects() == 0  # type: ignore[attr-defined]
    assert node["engine"] == {
        "kind": "llama-cpp-python",
        "found_by": 'GET /v1/models: owned_by "me" with permissions',
    }
    assert (node["capacity"], node["capacity_source"]) == (
        1,
        "auto (llama-cpp-python serves one request at a time)",
    )


def test_a_prompt_over_the_first_engines_context_goes_to_the_one_it_fits(
    fleet: Fleet, report: Report
) -> None:
    small = fleet.engine("llama-server", "small", ctx_size=512)
    big = fleet.engine("llama-server", "big", ctx_size=4096)
    proxy = fleet.proxy([("small", small.url), ("big", big.url)])  # small first
    prompt = long_prompt(60)  # some 850 tokens: over 512, well within 4096
    rid = request_id()
    exchange = Exchange.post(
        proxy.port, CHAT, chat_body(4, prompt=prompt), rid=rid, timeout=240
    ).read_all()
    [workload] = [w for w in proxy.status()["workloads"] if w["id"] == rid]
    attempts = [(a["node"], a["outcome"]) for a in workload["attempts"]]
    first = workload["attempts"][0]
    report.record(
        "10 prompt over the first engine's context",
        "llama-server",
        status=exchange.status,
        node=exchange.response_headers.get("x-failover-node"),
        attempts=exchange.response_headers.get("x-failover-attempts"),
        first=first.get("detail", ""),
    )
    assert exchange.status == 200, exchange.body_bytes[:300]
    assert exchange.complete
    assert exchange.response_headers["x-failover-node"] == "big"
    assert exchange.response_headers["x-failover-attempts"] == "2"
    assert attempts == [("small", "retryable_response"), ("big", "completed")]
    assert first["status"] == 400
    assert first["detail"].endswith("answered 400 context_length_exceeded")
