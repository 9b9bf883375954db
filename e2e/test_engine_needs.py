"""Scenario 5: what real engines and their clients need from the proxy (issue 19)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import Fleet
from harness import (
    CONTEXT,
    LOOPBACK,
    Exchange,
    chat_body,
    free_port,
    http_get,
    seconds_per_token,
    tokens_lasting,
)
from report import Report

CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S = 3.0
# The unstreamed answer lasts about this many header deadlines at the
# engine's measured speed: it needs to outlast one, on any machine.
UNSTREAMED_WINDOWS = 3


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
def test_request_without_client_id_is_served(fleet: Fleet, kind: str) -> None:
    engine = fleet.engine(kind)
    proxy = fleet.proxy([("a", engine.url)])
    # llama-cpp-python answers 400 to any X-Request-Id that is not a UUID.
    answer = Exchange.post(proxy.port, CHAT, chat_body(4, endless=False), rid=None).read_all()
    assert answer.status == 200, answer.body_bytes[:300]
    assert answer.response_headers["x-request-id"]
    status, _, body = http_get(proxy.port, "/v1/models")
    assert status == 200, body[:300]


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
def test_unstreamed_answer_longer_than_header_deadline(
    fleet: Fleet, report: Report, kind: str
) -> None:
    a, b = fleet.engines(kind, "a", "b")
    # Some UNSTREAMED_WINDOWS header timeouts of generation at a's speed
    # here and now, measured before the proxy exists.
    per_token = seconds_per_token(a.port)
    max_tokens = tokens_lasting(UNSTREAMED_WINDOWS * HEADER_TIMEOUT_S, per_token, CONTEXT - 64)
    proxy = fleet.proxy(
        [("a", a.url), ("b", b.url)], "--response-header-timeout", f"{HEADER_TIMEOUT_S:g}s"
    )
    started = time.monotonic()
    answer = Exchange.post(
        proxy.port, CHAT, chat_body(max_tokens, stream=False), timeout=120
    ).read_all()
    took = time.monotonic() - started
    assert answer.status == 200, answer.body_bytes[:300]
    assert answer.response_headers["x-failover-node"] == "a"
    assert answer.response_headers["x-failover-attempts"] == "1"
    assert answer.json()["usage"]["completion_tokens"] == max_tokens
    # It outlasted the deadline, by the proxy's count: a liveness check
    # passed and the request stayed at a.
    checks = proxy.last_request_checks()
    assert checks >= 1, (checks, took, max_tokens, per_token)
    report.record(
        "5 unstreamed answer, header deadline 3 s",
        kind,
        answered_after=round(took * 1000),
        completion_tokens=max_tokens,
        liveness_checks=checks,
    )


# llama-cpp-python's web server (sse-starlette) sends `: ping - DATE` every
# 15 s from the moment its streamed answer starts, whatever the model does.
PING_INTERVAL_S = 15.0
FIRST_BODY_TIMEOUT_S = 17.0
# How long each engine's direct request would run, at the speed measured
# here: about twice what the test needs of it (the deadline, plus the time
# to read the 504), so that a machine running faster than when it was
# measured still keeps the engine busy.
HOLD_S = 2 * (FIRST_BODY_TIMEOUT_S + 3)


def test_sse_pings_do_not_meet_first_body_deadline(fleet: Fleet, report: Report) -> None:
    """With the deadline on the pings are held; with it off they reach the client."""
    held_engine, passed_engine = fleet.engines("llama-cpp-python", "a", "b")
    per_token = seconds_per_token(held_engine.port)
    hold_tokens = tokens_lasting(HOLD_S, per_token, CONTEXT - 64)
    tap = fleet.tap(held_engine)  # what the engine sent before the proxy gave up
    holding = fleet.proxy([("a", tap.url)], "--first-body-timeout", f"{FIRST_BODY_TIMEOUT_S:g}s")
    passing = fleet.proxy([("b", passed_engine.url)])  # first-body-timeout 0, the default

    # Each engine is kept busy by a direct request, so the proxied one waits
    # behind it (--interrupt_requests False): head sent, pings, no token, as
    # during a long prefill, for as long as the test needs on any machine.
    blockers = [
        Exchange.post(engine.port, CHAT, chat_body(hold_tokens), timeout=60)
        for engine in (held_engine, passed_engine)
    ]
    for blocker in blockers:
        assert blocker.read_head() == 200
        assert len([e for e in blocker.read_events(2) if e.content()]) >= 2
    held = Exchange.post(holding.port, CHAT, chat_body(4), timeout=60)
    # A proxy that held the pings would send nothing until b is free, and b
    # is freed only after the ping: then the first bytes are a token.
    waiting = Exchange.post(passing.port, CHAT, chat_body(4), timeout=120)

    # Deadline off: the engine's ping is the client's first body bytes (and
    # the head comes with them: the proxy commits on the first body byte).
    assert waiting.read_head() == 200
    first = waiting.read_chunk() or b""
    ping_at = waiting.chunks[0][0] if waiting.chunks else 0.0
    assert first.startswith(b": ping"), first[:80]
    assert PING_INTERVAL_S <= ping_at < PING_INTERVAL_S + 3
    blockers[1].close()  # b stops it at its next token and takes the waiting request

    # Deadline on: the ping that a sent at 15 s committed nothing; the
    # deadline fired at 17 s with nothing else from a.
    if held.read_head() != 504:
        # Starting with ": ping": the proxy committed on it. With "data:":
        # a's direct request ended before the deadline (lengthen HOLD_S).
        first = held.read_chunk() or b""
        pytest.fail(f"{held.status} after {held.head_at:.1f} s, body {first[:40]!r}")
    held.read_all()
    engine_sent = tap.response_with(b"text/event-stream")
    assert b": ping" in engine_sent, "a sent no ping before the deadline: " + repr(engine_sent)
    assert b"data:" not in engine_sent, "a's first token came before the deadline: lengthen it"
    assert held.json()["error"]["code"] == "upstream_timeout"
    attempts = held.json()["attempts"]
    assert [(a["node"], a["outcome"]) for a in attempts] == [("a", "first_body_timeout")]
    assert FIRST_BODY_TIMEOUT_S <= held.head_at < FIRST_BODY_TIMEOUT_S + 3
    held_engine.signal(signal.SIGKILL)  # its direct request would run on for nobody

    waiting.read_all()
    assert waiting.complete
    assert waiting.events()[-1].data == "[DONE]"
    assert waiting.text()
    report.record(
        "5 SSE pings, first-body deadline 17 s",
        "llama-cpp-python",
        held_504_after=round(held.head_at * 1000),
        attempt_elapsed=attempts[0]["elapsed_ms"],
        deadline_off_ping_at=round(ping_at * 1000),
        hold_tokens=hold_tokens,
    )


def test_ollama_paths_get_ollama_shaped_errors(fleet: Fleet, log_dir: Path) -> None:
    """The proxy's own 502 and 404 on /api/ are Ollama's shape (no engine needed)."""
    refused = [free_port(), free_port()]  # nothing listens there: both nodes are dead
    config = log_dir / "fleet.toml"
    config.write_text(
        "".join(
            f'[[upstream]]\nname = "{name}"\nurl = "http://{LOOPBACK}:{port}"\nmodels = ["tiny"]\n'
            for name, port in zip("ab", refused, strict=True)
        )
    )
    proxy = fleet.proxy([], "--config", str(config))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}

    dead = Exchange.post(proxy.port, "/api/chat", chat).read_all()
    assert dead.status == 502, dead.body_bytes[:300]
    body = dead.json()
    assert sorted(body) == ["attempts", "code", "error"], body
    assert isinstance(body["error"], str), body
    assert body["code"] == "upstream_unavailable"
    # The health checks mark the dead nodes down as they find them, so either
    # may be tried first.
    assert sorted((a["node"], a["outcome"]) for a in body["attempts"]) == [
        ("a", "connect_failed"),
        ("b", "connect_failed"),
    ]

    unknown = Exchange.post(proxy.port, "/api/chat", {**chat, "model": "nope"}).read_all()
    assert unknown.status == 404, unknown.body_bytes[:300]
    body = unknown.json()
    assert isinstance(body["error"], str), body
    assert body["code"] == "model_not_found"
    assert body.get("attempts", []) == []  # no node was tried

    # The same failure outside /api/ keeps OpenAI's shape: the path decides.
    openai = Exchange.post(proxy.port, CHAT, chat).read_all()
    assert openai.status == 502
    assert openai.json()["error"]["type"] == "upstream_error"
