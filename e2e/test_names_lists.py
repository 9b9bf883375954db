"""Scenario 7: names the engines serve, and the fleet's list with a frozen engine (issue 27).

A single-model llama-server or llama-cpp-python lists one id (its alias) and
answers any name with its model. Through the proxy, once the first checks
have listed the aliases, the names a client was written for (``gpt-4o-mini``)
and Ollama's spelling of the alias (``tiny:latest``) must be served as
directly. And ``GET /v1/models`` with one engine stopped (SIGSTOP: its
kernel still accepts connections) must answer within about 2 s.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from conftest import Fleet
from harness import Exchange, chat_body, http_get, request_id, wait_for
from report import Report

CHAT = "/v1/chat/completions"
NAMES = ["gpt-4o-mini", "tiny:latest"]


def chat(port: int, name: str, node: str | None = None) -> Exchange:
    payload = chat_body(4, stream=False, model=name, endless=False)
    exchange = Exchange(port, "POST", CHAT, json.dumps(payload).encode(), timeout=120.0)
    exchange.headers += [("content-type", "application/json"), ("x-request-id", request_id())]
    if node is not None:
        exchange.headers.append(("x-failover-node", node))
    exchange.send()
    return exchange.read_all()


def test_names_a_single_model_engine_serves_are_served_through_the_proxy(
    fleet: Fleet, report: Report
) -> None:
    server, python = fleet.engines("llama-server", "a"), fleet.engines("llama-cpp-python", "b")
    engines = {"a": server[0], "b": python[0]}
    proxy = fleet.proxy(
        [(name, engine.url) for name, engine in engines.items()], "--discovery-interval", "2s"
    )
    # The first checks list the alias: from then on main answered 404.
    wait_for(
        lambda: all(proxy.node(name)["models"] == ["tiny"] for name in engines),
        15,
        what="both inventories listed",
    )
    for name in NAMES:
        for node, engine in engines.items():
            direct = chat(engine.port, name)
            assert direct.status == 200, direct.body_bytes()[:300]
            proxied = chat(proxy.port, name, node)
            assert proxied.status == direct.status, proxied.body_bytes()[:300]
            assert proxied.response_headers["x-failover-node"] == node
            assert proxied.response_headers["x-failover-attempts"] == "1"
            answer = proxied.json()
            assert answer["object"] == "chat.completion"
            assert answer["choices"][0]["message"]["role"] == "assistant"
    # Without a chosen node: a name no node lists goes to the first in ranking.
    unchosen = chat(proxy.port, "gpt-4o-mini")
    assert (unchosen.status, unchosen.response_headers["x-failover-node"]) == (200, "a")
    report.record("7 names a single-model engine serves", "both", names=", ".join(NAMES))


@pytest.mark.parametrize("discovery", ["0", "30s"])
def test_models_list_with_a_stopped_engine_answers_within_2_5_s(
    fleet: Fleet, report: Report, discovery: str
) -> None:
    (server,) = fleet.engines("llama-server", "a", alias="tiny-a")
    (python,) = fleet.engines("llama-cpp-python", "b", alias="tiny-b")
    # SIGSTOP before the proxy starts: with discovery on, a's first check
    # hangs too, so a has no inventory and is asked live.
    server.signal(signal.SIGSTOP)
    proxy = fleet.proxy([("a", server.url), ("b", python.url)], "--discovery-interval", discovery)
    figures = []
    for _ in range(2):
        started = time.monotonic()
        status, headers, body = http_get(proxy.port, "/v1/models", timeout=30)
        took = time.monotonic() - started
        figures.append(took)
        assert status == 200, body[:300]
        assert [(m["id"], m["nodes"]) for m in json.loads(body)["data"]] == [("tiny-b", ["b"])]
        assert headers.get("x-request-id")
        assert took < 2.5, f"GET /v1/models took {took:.2f} s with a stopped engine"
    server.signal(signal.SIGCONT)
    report.record(
        "7 GET /v1/models, one engine stopped (SIGSTOP)",
        f"discovery {discovery}",
        first_ms=round(figures[0] * 1000),
        second_ms=round(figures[1] * 1000),
    )
