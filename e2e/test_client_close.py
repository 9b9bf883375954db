"""Scenario 2: a client that leaves stops costing the engine anything."""

from __future__ import annotations

import time

import pytest
from conftest import Fleet
from harness import Exchange, LlamaCppPython, LlamaServer, chat_body, token_times, wait_for
from report import Report

KINDS = ["llama-server", "llama-cpp-python"]
CHAT = "/v1/chat/completions"
# Left alone, the abandoned request would run for 400 tokens: 20 s at ~20 tokens/s.
ABANDONED_TOKENS = 400
# Bounds on the engine's stop, from the client's leaving. Mid-stream the
# engines notice at their next token. Before the first token both finish the
# prompt first (llama-server and llama-cpp-python check between tokens), so
# that bound covers the rest of a prefill of LONG_PROMPT.
STOP_MID_S = 3.0
STOP_BEFORE_S = 15.0
NEXT_TTFT_S = 3.0


def long_prompt(lines: int) -> str:
    """A prompt of about 14 tokens a line: a prefill of seconds on one thread."""
    return "Summarise the following log. " + " ".join(
        f"line {n}: the lighthouse lamp was checked and found working." for n in range(lines)
    )


# llama-server reads ~250 prompt tokens/s here; llama-cpp-python is slower
# at it, so it gets a shorter prompt (its stop waits for the whole prefill).
PROMPT_LINES = {"llama-server": 50, "llama-cpp-python": 20}


@pytest.mark.parametrize("when", ["mid-stream", "before-first-token"])
@pytest.mark.parametrize("kind", KINDS)
def test_engine_stops_when_client_leaves(
    fleet: Fleet, report: Report, kind: str, when: str
) -> None:
    engine = fleet.engine(kind)
    proxy = fleet.proxy([("a", engine.url)])
    disconnects = engine.disconnects() if isinstance(engine, LlamaCppPython) else 0

    if when == "mid-stream":
        leaving = Exchange.post(proxy.port, CHAT, chat_body(ABANDONED_TOKENS))
        assert leaving.read_head() == 200
        assert len([e for e in leaving.read_events(5) if e.content()]) >= 5
        bound = STOP_MID_S
    else:
        leaving = Exchange.post(
            proxy.port, CHAT, chat_body(ABANDONED_TOKENS, prompt=long_prompt(PROMPT_LINES[kind]))
        )
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
    )
