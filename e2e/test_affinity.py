"""Scenario 8: cache affinity on real engines (issue 43).

Two llama-servers with two slots each and their default prompt cache (the
slots, and the host-memory cache of ``--cache-ram``). Eight conversations
of five turns, four at a time (two waves, each begun at once), each with a
context of its own of at least 1,500 tokens after a system prompt they all
share, their users pausing between turns to read the answer (3 s for a
wave's first, a half more for each next one; on a machine slow enough,
two short answers' time if that is more), with the defaults (cache
affinity on) and with ``--affinity off --balance least-loaded``, which
sends a turn that finds both nodes idle to the first, whatever it holds.
The two runs' texts differ, so that the second finds nothing of the first
in the caches but the shared system prompt.

What is asserted: every turn is answered, and with the defaults turns
match the cache of the node that serves them. The speed-up is measured
and recorded, not asserted: on a machine shared with other work the
engines' one thread each runs at whatever speed is left, and with two
slots a node running one turn more than the other is passed over (load
wins over cache at 0.5 above), which costs the moved turn a whole
prefill; and llama-server's host-memory prompt cache (``--cache-ram``,
8 GiB by default) keeps what a node served, so a conversation that moves
in the other run computes its prompt again only on its first visit to a
node. Recorded: the mean and the median first-token time of turns 2 to 5
and their 90th percentile in both runs, the share of turns that stayed on
the node of the turn before, and each node's conversations and turns.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from typing import Any

from conftest import Fleet
from harness import CHAT, PROMPT_TOKENS_PER_LINE, Exchange, seconds_per_token, token_times
from report import Report

CONVERSATIONS = 8
TURNS = 5
AT_A_TIME = 4  # conversations in progress at once (a wave): one per engine slot
OWN_LINES = 115  # about 1,600 tokens of each conversation's own
SYSTEM_LINES = 20  # about 280 tokens that every conversation sends first
ANSWER_TOKENS = 8
READING_S = 3.0  # the first user's pause between turns; the others' a half more each


def system_prompt() -> str:
    return "You are the assistant of a lighthouse company. Rules: " + " ".join(
        f"rule {n}: keep the lamp clean and log every check you make." for n in range(SYSTEM_LINES)
    )


def own_context(run: str, conversation: int) -> str:
    return f"Run {run}, file {conversation}. Summarise it. " + " ".join(
        f"{run}{conversation} line {n}: keeper {conversation} checked lamp {n} at dusk."
        for n in range(OWN_LINES)
    )


def converse(port: int, run: str, pause: float) -> list[dict[str, Any]]:
    """Eight conversations in waves of ``AT_A_TIME``; each turn's node and first-token time.

    ``pause``: the user of a wave's first conversation pauses that long
    between turns, the next ones a half more each, so that their turns
    drift apart.
    """
    turns: list[dict[str, Any]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def conversation(number: int) -> None:
        messages = [
            {"role": "system", "content": system_prompt()},
            {"role": "user", "content": own_context(run, number)},
        ]
        for turn in range(1, TURNS + 1):
            body = {
                "model": "tiny",
                "messages": messages,
                "max_tokens": ANSWER_TOKENS,
                "temperature": 0,
                "stream": True,
            }
            exchange = Exchange.post(port, CHAT, body, timeout=300).read_all()
            assert exchange.status == 200, exchange.body_bytes[:300]
            first, _ = token_times(exchange)
            answer = "".join(event.content() for event in exchange.events())
            with lock:
                turns.append(
                    {
                        "conversation": number,
                        "turn": turn,
                        "node": exchange.response_headers["x-failover-node"],
                        "first_token": first,  # since the request was sent
                    }
                )
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": f"And what about lamp {turn}?"})
            if turn < TURNS:
                time.sleep(pause * (1 + (number % AT_A_TIME) / 2))  # the user reads

    def run_one(number: int) -> None:
        try:
            conversation(number)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    for wave in range(0, CONVERSATIONS, AT_A_TIME):
        threads = [
            threading.Thread(target=run_one, args=(number,))
            for number in range(wave, wave + AT_A_TIME)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=900)
        assert not errors, errors
        assert all(not thread.is_alive() for thread in threads)
    assert len(turns) == CONVERSATIONS * TURNS
    return turns


def later_p50(turns: list[dict[str, Any]]) -> float:
    return statistics.median(t["first_token"] for t in turns if t["turn"] > 1)


def later_p90(turns: list[dict[str, Any]]) -> float:
    return statistics.quantiles((t["first_token"] for t in turns if t["turn"] > 1), n=10)[-1]


def later_mean(turns: list[dict[str, Any]]) -> float:
    return statistics.mean(t["first_token"] for t in turns if t["turn"] > 1)


def stayed(turns: list[dict[str, Any]]) -> float:
    node = {(t["conversation"], t["turn"]): t["node"] for t in turns}
    later = [t for t in turns if t["turn"] > 1]
    return sum(t["node"] == node[t["conversation"], t["turn"] - 1] for t in later) / len(later)


def spread(turns: list[dict[str, Any]]) -> str:
    homes = Counter(t["node"] for t in turns if t["turn"] == 1)
    served = Counter(t["node"] for t in turns)
    return " ".join(f"{node}:{homes[node]}/{served[node]}" for node in sorted(served))


def test_cache_affinity_on_real_engines(fleet: Fleet, report: Report) -> None:
    assert (OWN_LINES * PROMPT_TOKENS_PER_LINE) >= 1500
    a, b = fleet.engines("llama-server", "a", "b", parallel=2)
    # A user reads the answer before the next turn: a few seconds (or two
    # short answers' time, on a machine slow enough for that to be more).
    pause = max(READING_S, 2 * ANSWER_TOKENS * seconds_per_token(a.port))
    upstreams = [("a", a.url), ("b", b.url)]
    defaults = fleet.proxy(upstreams)
    with_affinity = converse(defaults.port, "one", pause)
    baseline_proxy = fleet.proxy(upstreams, "--affinity", "off", "--balance", "least-loaded")
    baseline = converse(baseline_proxy.port, "two", pause)
    on, off = later_mean(with_affinity), later_mean(baseline)
    hits = sum(node["affinity"]["hits"] for node in defaults.status()["nodes"])
    report.record(
        "8 cache affinity: first token of turns 2-5",
        "llama-server",
        mean_defaults=round(on * 1000),
        mean_affinity_off_least_loaded=round(off * 1000),
        p50_defaults=round(later_p50(with_affinity) * 1000),
        p50_affinity_off_least_loaded=round(later_p50(baseline) * 1000),
        p90_defaults=round(later_p90(with_affinity) * 1000),
        p90_affinity_off_least_loaded=round(later_p90(baseline) * 1000),
        ratio_of_means=round(on / off, 2),
        stayed_defaults=round(stayed(with_affinity), 2),
        stayed_off=round(stayed(baseline), 2),
        spread_defaults=spread(with_affinity),
        spread_off=spread(baseline),
        affinity_hits=hits,
        pause_ms=round(pause * 1000),
    )
    # Turns 2 to 5 all matched a chain at a node (it served the turn before,
    # or another conversation's system prompt at least).
    assert hits >= CONVERSATIONS * (TURNS - 1), hits
