"""Scenario 2: a client that leaves stops costing the engine anything."""

from __future__ import annotations

import time

import pytest
from conftest import Fleet
from harness import (
    CONTEXT,
    PROMPT_TOKENS_PER_LINE,
    Exchange,
    LlamaCppPython,
    LlamaServer,
    chat_body,
    lines_lasting,
    long_prompt,
    seconds_per_prompt_line,
    seconds_per_token,
    token_times,
    tokens_lasting,
    wait_for,
)
from report import Report

KINDS = ["llama-server", "llama-cpp-python"]
CHAT = "/v1/chat/completions"
# Bounds on the engine's stop, from the client's leaving. Mid-stream the
# engines notice at their next token. Before the first token both finish the
# prompt first (llama-server and llama-cpp-python check between tokens), so
# that bound covers the rest of a prefill of PREFILL_S.
STOP_MID_S = 3.0
STOP_BEFORE_S = 15.0
NEXT_TTFT_S = 3.0
# Sizes from the engine's speed, measured in the test: left alone, the
# abandoned request would generate for ABANDONED_S (or as far as its context
# allows), far past the bounds, so an engine still at it fails them; the
# prompt the client leaves during takes about PREFILL_S to read, long enough
# to be seen under way, short enough for STOP_BEFORE_S to cover its rest.
ABANDONED_S = 40.0
PREFILL_S = 4.0
# llama-server gets room for both on a machine three times as fast as the
# test's first one (a prompt of ~3,000 tokens, then 40 s at 150 tokens/s);
# llama-cpp-python keeps the harness's (a prompt of ~1,000, then ~20 s).
CONTEXTS = {"llama-server": 16384, "llama-cpp-python": CONTEXT}


@pytest.mark.parametrize("when", ["mid-stream", "before-first-token"])
@pytest.mark.parametrize("kind", KINDS)
def test_engine_stops_when_client_leaves(
    fleet: Fleet, report: Report, kind: str, when: str
) -> None:
    context = CONTEXTS[kind]
    engine = fleet.engine(kind, ctx_size=context)
    per_token = seconds_per_token(engine.port)
    lines = 0
    if when == "before-first-token":
        lines = lines_lasting(PREFILL_S, seconds_per_prompt_line(engine.port), context // 2)
    room = context - PROMPT_TOKENS_PER_LINE * lines - 64
    abandoned = chat_body(tokens_lasting(ABANDONED_S, per_token, room))
    proxy = fleet.proxy([("a", engine.url)])
    disconnects = engine.disconnects() if isinstance(engine, LlamaCppPython) else 0

    if when == "mid-stream":
        leaving = Exchange.post(proxy.port, CHAT, abandoned)
        assert leaving.read_head() == 200
        assert len([e for e in leaving.read_events(5) if e.content()]) >= 5
        bound = STOP_MID_S
    else:
        abandoned["messages"][0]["content"] = long_prompt(lines)
        leaving = Exchange.post(proxy.port, CHAT, abandoned)
        wait_for(engine.busy, 10, what=f"{engine.name} to start on the prompt")
        # Still in the prefill: not one byte for the client yet.
        assert leaving.nothing_yet(), leaving.peeked
        bound = STOP_BEFORE_S
    left = time.monotonic()
    leaving.close()

    if isinstance(engine, LlamaServer):
        wait_for(lambda: not engine.busy(), bound, what="the slot to be idle after the client left")
    else:
        wait_for(
            lambda: engine.disconnects() > disconnects, bound, what="the engine's disconnect line"
        )
    stopped = time.monotonic() - left
    # Its CPU goes quiet: a thread still generating would use a whole core.
    cpu_before = engine.cpu_seconds()
    time.sleep(1.0)
    cpu_share = engine.cpu_seconds() - cpu_before
    assert cpu_share < 0.3, f"{engine.name} still busy after its client left: {cpu_share:.2f} s/s"

    # The next request starts at once: nothing is left ahead of it.
    following = Exchange.post(proxy.port, CHAT, chat_body(4)).read_all()
    assert following.status == 200
    assert following.complete
    first_token, _ = token_times(following)
    assert first_token < NEXT_TTFT_S
    report.record(
        f"2 client left {when}",
        kind,
        engine_stopped_after=round(stopped * 1000),
        cpu_after_s_per_s=round(cpu_share, 2),
        next_ttft=round(first_token * 1000),
        max_tokens=abandoned["max_tokens"],
        prompt_lines=lines,
    )
