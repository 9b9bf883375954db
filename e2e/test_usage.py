"""Usage per client on real engines: what the proxy counts is what the engines told.

Two llama-servers (``--parallel 2``) behind the proxy, two client keys,
each sending an unstreamed chat, a stream (llama-server tells its tokens
in the last event's ``timings``) and a stream with
``stream_options.include_usage`` (a last ``usage`` event). The proxy relays
the engines' bytes unchanged, so each answer read here is the engine's own:
its ``usage`` (or ``timings``) is what the engine reported. ``GET /usage``
and the access lines must say the same, for each client, none estimated.
"""

from __future__ import annotations

import json
import re
from typing import Any

from conftest import Fleet
from harness import Exchange, chat_body, http_get, request_id, wait_for

CHAT = "/v1/chat/completions"
KEYS = {"alice": "ka-usage-3f9e1c07d2b8", "bob": "kb-usage-81c4e2a9f0d3"}
MAX_TOKENS = 6
_FIELD = re.compile(r"(\w+)=(\S+)")


def ask(port: int, key: str, body: dict[str, Any]) -> Exchange:
    headers = [
        ("content-type", "application/json"),
        ("authorization", f"Bearer {key}"),
        ("x-request-id", request_id()),
    ]
    exchange = Exchange(port, "POST", CHAT, json.dumps(body).encode(), headers, 60.0)
    exchange.send()
    return exchange.read_all()


def told(exchange: Exchange, streamed: bool) -> tuple[int, int]:
    """The tokens the engine reported in its own answer: usage, else llama-server's timings."""
    if not streamed:
        usage = exchange.json()["usage"]
        return usage["prompt_tokens"], usage["completion_tokens"]
    documents = [json.loads(e.data) for e in exchange.events() if e.data != "[DONE]"]
    last = documents[-1]
    if last.get("usage"):
        return last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]
    timings = last["timings"]
    return timings["prompt_n"] + timings["cache_n"], timings["predicted_n"]


def usage_after(port: int, requests: int) -> list[dict[str, Any]]:
    """``GET /usage``'s entries once they count ``requests`` in all.

    A workload is counted as it ends, just after its last byte went to the
    client: the client may ask before that.
    """
    found: list[list[dict[str, Any]]] = []

    def counted() -> bool:
        code, _, raw = http_get(port, "/usage")
        assert code == 200
        entries = json.loads(raw)["clients"]
        found[:] = [entries]
        return sum(entry["requests"] for entry in entries) >= requests

    wait_for(counted, 10, what=f"GET /usage to count {requests} requests")
    return found[0]


def access_lines(text: str) -> dict[str, dict[str, str]]:
    """The access lines of the proxy's log, by request id."""
    lines = {}
    for line in text.splitlines():
        if " request " in line and " prompt_tokens=" in line:
            fields = dict(_FIELD.findall(line))
            lines[fields["id"]] = fields
    return lines


def test_usage_per_client_is_what_the_engines_told(fleet: Fleet) -> None:
    engines = fleet.engines("llama-server", "a", "b", parallel=2)
    keys = [arg for name, key in KEYS.items() for arg in ("--api-key", f"{name}={key}")]
    proxy = fleet.proxy([(engine.name, engine.url) for engine in engines], *keys)

    expected: dict[str, list[int]] = {name: [0, 0] for name in KEYS}
    by_id: dict[str, tuple[int, int]] = {}
    for name, key in KEYS.items():
        prompt = f"Say something to {name}."
        for streamed, include_usage in ((False, False), (True, False), (True, True)):
            body = chat_body(MAX_TOKENS, stream=streamed, prompt=prompt)
            if include_usage:
                body["stream_options"] = {"include_usage": True}
            exchange = ask(proxy.port, key, body)
            assert exchange.status == 200, exchange.body_bytes[:300]
            tokens = told(exchange, streamed)
            assert tokens[1] == MAX_TOKENS
            expected[name][0] += tokens[0]
            expected[name][1] += tokens[1]
            by_id[exchange.response_headers["x-request-id"]] = tokens

    entries = {entry["client"]: entry for entry in usage_after(proxy.admin_port, len(by_id))}
    assert set(entries) == set(KEYS)
    for name, (prompt_tokens, completion_tokens) in expected.items():
        entry = entries[name]
        assert entry["model"] == "tiny"
        assert entry["requests"] == 3
        assert (entry["prompt_tokens"], entry["completion_tokens"]) == (
            prompt_tokens,
            completion_tokens,
        )
        assert entry["estimated"] == 0
        assert entry["slot_seconds"] > 0
        assert entry["last_hour"]["prompt_tokens"] == prompt_tokens

    # The access lines say the same, request by request (written as each ends).
    wait_for(lambda: len(access_lines(proxy.log_text())) >= len(by_id), 10, what="access lines")
    lines = access_lines(proxy.log_text())
    for rid, (prompt_tokens, completion_tokens) in by_id.items():
        line = lines[rid]
        assert (int(line["prompt_tokens"]), int(line["completion_tokens"])) == (
            prompt_tokens,
            completion_tokens,
        ), line
        assert line["usage_estimated"] == "false"


def test_llama_cpp_python_told_and_estimated(fleet: Fleet) -> None:
    # Its unstreamed answer tells its usage; its streams tell nothing, with
    # include_usage or not: the proxy counts their events, marked estimated.
    engine = fleet.engine("llama-cpp-python")
    proxy = fleet.proxy([("a", engine.url)])
    unstreamed = Exchange.post(proxy.port, CHAT, chat_body(MAX_TOKENS, stream=False)).read_all()
    assert unstreamed.status == 200, unstreamed.body_bytes[:300]
    usage = unstreamed.json()["usage"]
    body = chat_body(MAX_TOKENS, stream=True)
    body["stream_options"] = {"include_usage": True}
    streamed = Exchange.post(proxy.port, CHAT, body).read_all()
    assert streamed.status == 200
    events = [e.data for e in streamed.events()]
    assert not any('"usage"' in data for data in events)  # it told nothing

    [entry] = usage_after(proxy.admin_port, 2)
    assert (entry["client"], entry["requests"], entry["estimated"]) == ("anonymous", 2, 1)
    # Told: exact. Estimated: one token per event but [DONE].
    assert entry["completion_tokens"] == usage["completion_tokens"] + len(events) - 1
    prompt = -(-len(streamed.body) // 4)
    assert entry["prompt_tokens"] == usage["prompt_tokens"] + prompt
