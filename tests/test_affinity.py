"""Cache affinity through the running proxy, under MockClock (docs/capacity.md).

Two nodes of 2 slots simulate an engine's prompt cache (``PromptCache``:
the time to first byte grows with the part of the prompt the node does not
hold; each holds the last four prompts it served). Eight conversations of
five turns, 4 KiB of their own context each, their users pausing between
turns, with the defaults, and again with ``--affinity off --balance
least-loaded``: the turns stay where their conversation's cache is, the
first byte comes in half the time or less, and with ``least-loaded`` the
conversations' homes spread over the nodes, with or without a long system
prompt that all of them share. With capacity 2 the load rule passes a home
over as soon as it runs one request more than the other node, so the
conversations here are idle most of the time, as chats are.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from typing import Any

import attrs
import pytest
import trio
from conftest import LogRecords

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    FakeNode,
    Fleet,
    NodeIO,
    PromptCache,
    ReceivedRequest,
    frozen,
    healthy,
    request,
)

CONVERSATIONS = 8
TURNS = 5
AT_A_TIME = 8  # conversations in progress at once
ENTRIES = 4  # prompts each node's cache holds: half the conversations
# Per conversation: the answer's length (10 ms a token), and the pause before
# the next turn (the user reads and types): a chat is idle most of the time.
TOKENS = [9, 12, 12, 24, 15, 21, 21, 36]
THINK = [5.7, 4.3, 9.4, 12.0, 9.1, 10.4, 10.9, 8.1]
SHARED = "You are the coding agent of a large app; follow its rules. " * 140  # 8.3 KiB


def make_proxy(fleet: Fleet, **settings: Any) -> Proxy:
    upstreams = [attrs.evolve(node, capacity=2) for node in fleet.upstreams()]
    settings.setdefault("liveness_interval", 0)
    return Proxy(
        Config(upstreams=upstreams, admin_listen=None, **settings), connector=fleet.connector
    )


def own_text(conversation: int, turn: int, size: int) -> str:
    return f"[conversation {conversation} turn {turn}] " + "lorem ipsum dolor " * (size // 18)


@attrs.define
class Turn:
    conversation: int
    turn: int
    node: str
    ttfb: float


async def converse(proxy: Proxy, *, system: str | None) -> list[Turn]:
    """Eight conversations of five turns, ``AT_A_TIME`` in progress at once."""
    turns: list[Turn] = []
    lanes = trio.Semaphore(AT_A_TIME)

    async def conversation(number: int) -> None:
        async with lanes:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": own_text(number, 1, 4096)})
            for turn in range(1, TURNS + 1):
                document = {"model": "m", "messages": messages, "max_tokens": TOKENS[number]}
                body = json.dumps(document).encode()
                rid = f"c{number}t{turn}"
                response = await request(proxy, body=body, headers=[("x-request-id", rid)])
                assert response is not None
                assert response.status == 200
                work = next(work for work, _ in proxy.report.recent if work.id == rid)
                assert work.committed_at is not None
                ttfb = work.committed_at - work.started  # the head: the prefill's end
                turns.append(Turn(number, turn, response.header("x-failover-node") or "", ttfb))
                messages.append({"role": "assistant", "content": f"answer {number}.{turn}"})
                messages.append({"role": "user", "content": own_text(number, turn + 1, 512)})
                await trio.sleep(THINK[number])  # the user reads, or the agent's tool runs

    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            for number in range(CONVERSATIONS):
                nursery.start_soon(conversation, number)
                await trio.sleep(0.01)  # in a fixed order
    return turns


async def run(system: str | None, **settings: Any) -> tuple[list[Turn], dict[str, PromptCache]]:
    caches = {name: PromptCache(entries=ENTRIES) for name in "ab"}
    async with Fleet({name: FakeNode(cache) for name, cache in caches.items()}) as fleet:
        turns = await converse(make_proxy(fleet, **settings), system=system)
    return turns, caches


def stayed(turns: list[Turn]) -> float:
    """The share of turns 2-5 served by the node of the turn before."""
    node = {(t.conversation, t.turn): t.node for t in turns}
    later = [t for t in turns if t.turn > 1]
    return sum(t.node == node[t.conversation, t.turn - 1] for t in later) / len(later)


def ttfb_p50(turns: list[Turn]) -> float:
    return statistics.median(t.ttfb for t in turns if t.turn > 1)


def homes(turns: list[Turn]) -> Counter[str]:
    return Counter(t.node for t in turns if t.turn == 1)


@pytest.mark.parametrize("system", [None, SHARED], ids=["own-context", "shared-system-prompt"])
async def test_turns_stay_with_their_cache_and_come_faster(
    autojump_clock: trio.abc.Clock, system: str | None
) -> None:
    turns, caches = await run(system)  # the defaults
    assert len(turns) == CONVERSATIONS * TURNS
    assert stayed(turns) >= 0.9
    baseline, _ = await run(system, affinity="off", balance="least-loaded")
    assert ttfb_p50(turns) <= ttfb_p50(baseline) / 2, (ttfb_p50(turns), ttfb_p50(baseline))
    assert sum(len(cache.prefills) for cache in caches.values()) == CONVERSATIONS * TURNS
    # the homes spread, even with the shared system prompt
    spread, _ = await run(system, balance="least-loaded")
    assert all(3 <= homes(spread)[node] <= 5 for node in "ab"), homes(spread)
    assert ttfb_p50(spread) <= ttfb_p50(baseline) / 2


# -- the wiring, turn by turn -----------------------------------------------------------


def turn_body(*contents: str, system: str | None = None) -> bytes:
    messages = [{"role": "system", "content": system}] if system else []
    for index, content in enumerate(contents):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": content})
    return json.dumps({"model": "m", "messages": messages}).encode()


TURN1 = turn_body("a question of my own")
TURN2 = turn_body("a question of my own", "an answer", "and another")
TURN3 = turn_body("a question of my own", "an answer", "and another", "sure", "last one")
# "user\0a question of my own": 25 bytes; "assistant\0an answer": 19; "user\0and another": 16
TURN1_BYTES, TURN2_BYTES = 25, 25 + 19 + 16


async def ask(proxy: Proxy, body: bytes, rid: str, *headers: tuple[str, str]) -> str:
    response = await request(proxy, body=body, headers=[("x-request-id", rid), *headers])
    assert response is not None
    assert response.status == 200
    return response.header("x-failover-node") or ""


def access_lines(logged: LogRecords) -> dict[str, dict[str, Any]]:
    lines = [r.fields for r in logged.records if r.name == "trio_failover.access"]  # type: ignore[attr-defined]
    return {line["id"]: line for line in lines}


async def test_a_turn_goes_home_and_is_counted_in_status_metrics_and_the_access_line(
    autojump_clock: trio.abc.Clock, logged: LogRecords
) -> None:
    async with Fleet({name: FakeNode(healthy()) for name in "ab"}) as fleet:
        proxy = make_proxy(fleet, balance="least-loaded")
        # b served turn 1 (selected): the conversation's home is b, though
        # least-loaded would put every request on a (all idle: ties go first)
        assert await ask(proxy, TURN1, "t1", ("x-failover-node", "b")) == "b"
        assert await ask(proxy, TURN2, "t2") == "b"
        assert await ask(proxy, TURN3, "t3") == "b"
        assert await ask(proxy, turn_body("someone else"), "new") == "a"  # by --balance
        nodes = {node["name"]: node for node in proxy.status()["nodes"]}
        assert nodes["b"]["affinity"] == {
            "hits": 2,
            "misses": 1,
            "matched_bytes": TURN1_BYTES + TURN2_BYTES,
        }
        assert nodes["a"]["affinity"] == {"hits": 0, "misses": 1, "matched_bytes": 0}
        text, _ = proxy.metrics.render()
        assert b'trio_failover_affinity_requests_total{node="b",result="hit"} 2.0' in text
        assert b'trio_failover_affinity_requests_total{node="b",result="miss"} 1.0' in text
        assert b'trio_failover_affinity_requests_total{node="a",result="hit"} 0.0' in text
        matched = TURN1_BYTES + TURN2_BYTES
        assert b'trio_failover_affinity_matched_bytes_total{node="b"} %d.0' % matched in text
    lines = access_lines(logged)
    assert (lines["t1"]["affinity"], lines["t1"]["matched_bytes"]) == ("miss", 0)
    assert (lines["t2"]["affinity"], lines["t2"]["matched_bytes"]) == ("hit", TURN1_BYTES)
    assert (lines["t3"]["affinity"], lines["t3"]["matched_bytes"]) == ("hit", TURN2_BYTES)


async def test_off_remembers_nothing_and_says_nothing(
    autojump_clock: trio.abc.Clock, logged: LogRecords
) -> None:
    async with Fleet({name: FakeNode(healthy()) for name in "ab"}) as fleet:
        proxy = make_proxy(fleet, affinity="off")
        assert await ask(proxy, TURN1, "t1", ("x-failover-node", "b")) == "b"
        assert await ask(proxy, TURN2, "t2") == "a"  # priority
        assert len(proxy.affinity.memory) == 0
    assert "affinity" not in access_lines(logged)["t2"]


async def test_x_failover_node_wins_and_the_node_that_served_is_the_home(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({name: FakeNode(healthy()) for name in "ab"}) as fleet:
        proxy = make_proxy(fleet)
        assert await ask(proxy, TURN1, "t1") == "a"
        assert await ask(proxy, TURN2, "t2", ("x-failover-node", "b")) == "b"
        assert await ask(proxy, TURN3, "t3") == "b"  # b holds the longer match


async def test_load_wins_over_cache_at_half_a_node_more(autojump_clock: trio.abc.Clock) -> None:
    held = trio.Event()

    async def hold(io: NodeIO, received: ReceivedRequest) -> None:
        if received.header("x-request-id") == b"busy":
            await held.wait()
        await healthy()(io, received)

    async with Fleet({"a": FakeNode(hold), "b": FakeNode(healthy())}) as fleet:
        # capacity 2 each; with priority, a passed over is still the first free
        proxy = make_proxy(fleet, balance="least-loaded")
        assert await ask(proxy, TURN1, "t1") == "a"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, proxy, turn_body("busy"), "busy")
            await trio.sleep(1)
            # a runs one request, b none: 1/2 - 0/2 = 0.5, load wins
            assert await ask(proxy, TURN2, "t2") == "b"
            # b holds more of it now: one request at a is no more than at b
            assert await ask(proxy, TURN3, "t3") == "b"
            held.set()


async def test_a_cooling_home_is_not_lifted(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({name: FakeNode(healthy()) for name in "ab"}) as fleet:
        proxy = make_proxy(fleet)
        assert await ask(proxy, TURN1, "t1", ("x-failover-node", "b")) == "b"
        fleet["b"].behaviour = frozen()
        # b sends no head within the timeout and cools; a serves that request
        assert await ask(proxy, turn_body("other"), "cool-b", ("x-failover-node", "b")) == "a"
        fleet["b"].behaviour = healthy()
        assert proxy.status()["nodes"][1]["state"] in ("cooling", "down")
        assert await ask(proxy, TURN2, "t2") == "a"  # its home cools: not lifted
