"""Usage through the running proxy: fake engines that tell their tokens as the real ones do.

Two clients (keys), a llama-server of two slots and a llama-cpp-python, under
MockClock: each answer's tokens reach the access line, ``/status``, the
terminal event, the tokens metric and ``GET /usage`` (requests, tokens,
estimates, and slot-seconds exact to the virtual clock).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from conftest import LogRecords

from trio_failover import ClientKey, Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.service.admin import _route
from trio_failover.testing import FakeLlamaCppPython, FakeLlamaServer, FakeNode, Fleet, request

ALICE, BOB = "ka-0123456789abcdef", "kb-0123456789abcdef"
CLIENTS = (ClientKey("alice", ALICE), ClientKey("bob", BOB))
TOKENS = 4  # each fake answer's completion tokens
TOKEN_DELAY = 0.25  # so each answer holds its slot 1.0 s
# Three words of prompt: the fakes' tokens.
MESSAGES = [{"role": "user", "content": "one two three"}]


def body(model: str, *, stream: bool, include_usage: bool = False) -> bytes:
    document: dict[str, Any] = {"model": model, "messages": MESSAGES, "stream": stream}
    if include_usage:
        document["stream_options"] = {"include_usage": True}
    return json.dumps(document).encode()


@asynccontextmanager
async def running(fleet: Fleet) -> AsyncIterator[Proxy]:
    upstreams = [
        Upstream("ls", "http://ls.invalid:80", models=["tiny"], capacity=2),
        Upstream("lcp", "http://lcp.invalid:80", models=["other"], capacity=1),
    ]
    config = Config(upstreams=upstreams, admin_listen=None, clients=CLIENTS)
    async with Proxy(config, connector=fleet.connector) as proxy:
        yield proxy


async def ask(proxy: Proxy, key: str, payload: bytes) -> None:
    headers = [("authorization", f"Bearer {key}")]
    response = await request(proxy, body=payload, headers=headers)
    assert response is not None
    assert response.status == 200, response.body


def access_lines(logged: LogRecords) -> list[dict[str, Any]]:
    return [r.fields for r in logged.records if r.name == "trio_failover.access"]  # type: ignore[attr-defined]


async def test_tokens_of_every_answer_reach_every_output(
    autojump_clock: trio.abc.Clock, logged: LogRecords
) -> None:
    engines = {
        "ls": FakeLlamaServer(slots=2, tokens=TOKENS, token_delay=TOKEN_DELAY),
        "lcp": FakeLlamaCppPython(model="other", tokens=TOKENS, token_delay=TOKEN_DELAY),
    }
    fakes = {name: FakeNode(engine) for name, engine in engines.items()}
    async with Fleet(fakes) as fleet, running(fleet) as proxy:
        with proxy.events.subscribe(0) as events:
            # llama-server: unstreamed (usage), streamed (timings), with include_usage
            await ask(proxy, ALICE, body("tiny", stream=False))
            await ask(proxy, ALICE, body("tiny", stream=True))
            await ask(proxy, BOB, body("tiny:latest", stream=True, include_usage=True))
            # llama-cpp-python's stream tells nothing: estimated
            estimated_body = body("other", stream=True, include_usage=True)
            await ask(proxy, BOB, estimated_body)
            terminal = []
            while True:
                try:
                    event = events.receive.receive_nowait()
                except trio.WouldBlock:
                    break
                if event.get("type") == "workload" and event["state"] == "completed":
                    terminal.append(event)
        now = trio.current_time()
        usage = json.loads((await _route(proxy, _get(b"/usage"), b"/usage", None)).body)
        status = proxy.status()
        metrics = proxy.report.metrics.registry

    told = (3, TOKENS, False)  # the fakes' prompt: three words
    # a prompt token per 4 bytes of body; 4 tokens and the finish event
    prompt = -(-len(estimated_body) // 4)
    estimated = (prompt, TOKENS + 1, True)
    expected = [told, told, told, estimated]
    lines = access_lines(logged)
    assert [(a["client"], a["prompt_tokens"], a["completion_tokens"], a["usage_estimated"])
            for a in lines] == [("alice", *told), ("alice", *told), ("bob", *told),
                                ("bob", *estimated)]  # fmt: skip
    assert [(e["prompt_tokens"], e["completion_tokens"], e["usage_estimated"])
            for e in terminal] == expected  # fmt: skip
    recent = [w for w in status["workloads"] if w["state"] == "completed"]
    assert sorted((w["prompt_tokens"], w["completion_tokens"], w["usage_estimated"])
                  for w in recent) == sorted(expected)  # fmt: skip
    hour = {"requests": 2, "prompt_tokens": 6, "completion_tokens": 8, "estimated": 0}
    assert usage == {
        "clients": [
            {"client": "alice", "model": "tiny", **hour, "slot_seconds": 2.0,
             "last_hour": {**hour, "slot_seconds": 2.0}},
            {"client": "bob", "model": "other", "requests": 1, "prompt_tokens": prompt,
             "completion_tokens": 5, "estimated": 1, "slot_seconds": 1.0,
             "last_hour": {"requests": 1, "prompt_tokens": prompt, "completion_tokens": 5,
                           "estimated": 1, "slot_seconds": 1.0}},
            {"client": "bob", "model": "tiny:latest", "requests": 1, "prompt_tokens": 3,
             "completion_tokens": 4, "estimated": 0, "slot_seconds": 1.0,
             "last_hour": {"requests": 1, "prompt_tokens": 3, "completion_tokens": 4,
                           "estimated": 0, "slot_seconds": 1.0}},
        ]
    }  # fmt: skip
    assert now == 4.0  # four answers of 1.0 s, one after another

    def tokens(client: str, model: str, node: str, kind: str) -> float | None:
        labels = {"client": client, "model": model, "node": node, "kind": kind}
        return metrics.get_sample_value("trio_failover_tokens_total", labels)

    assert tokens("alice", "tiny", "ls", "prompt") == 6
    assert tokens("alice", "tiny", "ls", "completion") == 8
    assert tokens("bob", "other", "lcp", "completion") == 5


def _get(path: bytes) -> Any:
    from trio_failover.wire.client import ClientRequest

    return ClientRequest(b"GET", path, [], b"", b"1.1")


async def test_a_cut_stream_counts_what_came(
    autojump_clock: trio.abc.Clock, logged: LogRecords
) -> None:
    # The client leaves after two tokens: the answer's events so far are
    # its estimate (llama-server tells its timings only at the end).
    engines = {"ls": FakeLlamaServer(slots=2, tokens=TOKENS, token_delay=TOKEN_DELAY)}
    async with Fleet({"ls": FakeNode(engines["ls"])}) as fleet:
        upstreams = [Upstream("ls", "http://ls.invalid:80", models=["tiny"], capacity=2)]
        config = Config(upstreams=upstreams, admin_listen=None)
        async with Proxy(config, connector=fleet.connector) as proxy:
            headers = [("x-request-id", "cut")]
            gone = await request(
                proxy, body=body("tiny", stream=True), headers=headers, leave_after=0.6
            )
            assert gone is None
            await trio.sleep(5)
            usage = await proxy.usage()
    [line] = access_lines(logged)
    assert line["state"] == "cancelled"
    assert (line["completion_tokens"], line["usage_estimated"]) == (2, True)
    [entry] = usage["clients"]
    assert (entry["client"], entry["requests"], entry["estimated"]) == ("anonymous", 1, 1)
    assert logging.INFO  # the access logger is on at the fixture's DEBUG
