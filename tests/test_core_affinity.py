"""Table tests of cache affinity's pure core (trio_failover.core.affinity).

Three parts: a prompt's chain of block hashes, the memory of what each node
served (bounded, oldest forgotten first), and the choice of the node a
request prefers (longest match beyond the shared part, load first).
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

import pytest

from trio_failover.core.affinity import (
    BLOCK_BYTES,
    MAX_BLOCKS,
    AffinityMemory,
    Candidate,
    Chain,
    Matches,
    Served,
    prefer,
    prompt_chain,
)


def _chat(*contents: str, system: str | None = None, model: str = "m") -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    roles = itertools.cycle(["user", "assistant"])
    messages += [
        {"role": role, "content": text} for role, text in zip(roles, contents, strict=False)
    ]
    return {"model": model, "messages": messages}


def chain(document: dict[str, Any]) -> Chain:
    found = prompt_chain(document)
    assert found is not None
    return found


# -- the chain ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "document",
    [
        ["messages"],
        "hello",
        None,
        {"model": "m"},
        {},
        {"model": "m", "messages": None, "prompt": None},
        {"model": "m", "messages": []},
        {"model": "m", "prompt": ""},
    ],
    ids=[
        "list",
        "string",
        "none",
        "no-prompt",
        "empty",
        "both-null",
        "no-messages",
        "empty-prompt",
    ],
)
def test_no_prompt_no_chain(document: Any) -> None:
    assert prompt_chain(document) is None


def test_a_chat_has_a_block_per_message_and_counts_its_bytes() -> None:
    found = chain(_chat("hi", "hello there", system="be brief"))
    assert len(found.hashes) == 3
    # role, a NUL, the content: "system\0be brief" is 15 bytes
    assert found.ends == (15, 15 + 7, 15 + 7 + 21)
    assert found.matched_bytes(0) == 0
    assert found.matched_bytes(2) == 22


def test_the_chain_is_cumulative_so_a_next_turn_extends_it() -> None:
    turn1 = chain(_chat("plan the trip", system="S"))
    turn2 = chain(_chat("plan the trip", "here is a plan", "cheaper", system="S"))
    assert turn2.hashes[:2] == turn1.hashes
    # the same message after a different history is another block
    other = chain(_chat("plan the trip", system="T"))
    assert other.hashes[1] != turn1.hashes[1]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (_chat("hi", model="llama3"), _chat("hi", model="llama3:latest")),
        ({"model": "m", "prompt": "abc"}, {"model": "m", "prompt": "abc", "stream": True}),
        (
            {"model": "m", "messages": [{"content": "x", "role": "user"}]},
            {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        ),
    ],
    ids=["ollama-latest", "options-ignored", "key-order"],
)
def test_same_chain(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert chain(first).hashes == chain(second).hashes


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (_chat("hi", model="a"), _chat("hi", model="b")),
        (_chat("hi"), {"model": "m", "messages": [{"role": "system", "content": "hi"}]}),
        ({"model": "m", "prompt": "abc"}, {"model": "m", "prompt": "abd"}),
        (
            {"model": "m", "prompt": "abc", "system": "be kind"},
            {"model": "m", "prompt": "abc"},
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        ),
    ],
    ids=["model", "role", "prompt", "ollama-system", "content-parts"],
)
def test_different_chain(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert chain(first).hashes[-1] != chain(second).hashes[-1]


def test_a_completion_is_cut_in_fixed_blocks_and_a_growing_one_keeps_them() -> None:
    text = "x" * (3 * BLOCK_BYTES + 10)
    found = chain({"model": "m", "prompt": text})
    assert found.ends == (BLOCK_BYTES, 2 * BLOCK_BYTES, 3 * BLOCK_BYTES, 3 * BLOCK_BYTES + 10)
    longer = chain({"model": "m", "prompt": text + "y" * 2000})
    assert longer.hashes[:3] == found.hashes[:3]
    assert longer.hashes[3] != found.hashes[3]  # the last, partial block grew


def test_a_prompt_list_and_odd_text_hash() -> None:
    assert len(chain({"model": "m", "prompt": ["a", "b"]}).hashes) == 1
    assert len(chain({"model": "m", "prompt": "\ud800 lone surrogate"}).hashes) == 1
    assert len(chain({"prompt": "no model"}).hashes) == 1


def test_the_chain_is_bounded() -> None:
    huge = chain({"model": "m", "prompt": "z" * (BLOCK_BYTES * (MAX_BLOCKS + 5))})
    assert len(huge.hashes) == MAX_BLOCKS
    many = chain(_chat(*["m"] * (MAX_BLOCKS + 5)))
    assert len(many.hashes) == MAX_BLOCKS


# -- the memory ----------------------------------------------------------------------------

S = "You are the agent of a large app. " * 250  # about 8 KiB: a shared system prompt


def test_the_longest_match_per_node() -> None:
    memory = AffinityMemory()
    memory.remember("a", chain(_chat("one", "r1", "two", system="x")).hashes)
    memory.remember("b", chain(_chat("other", system="x")).hashes)
    found = memory.match(chain(_chat("one", "r1", "two", "r2", "three", system="x")))
    # "x" is held by both nodes: shared; a has four blocks of it, b one.
    assert found == Matches({"a": 4, "b": 1}, shared=1)


def test_a_shared_opening_on_one_node_is_found_shared_by_the_next_conversation() -> None:
    memory = AffinityMemory()
    memory.remember("a", chain(_chat("conversation one", system=S)).hashes)
    # another conversation: the system prompt goes on differently from what a
    # served, so it is an opening shared by two conversations
    found = memory.match(chain(_chat("conversation two", system=S)))
    assert found == Matches({"a": 1}, shared=1)
    # the first conversation's next turn: a holds its own part too
    again = memory.match(chain(_chat("conversation one", "answer", "more", system=S)))
    assert again == Matches({"a": 2}, shared=0)


def test_a_branch_once_seen_stays_shared() -> None:
    memory = AffinityMemory()
    memory.remember("a", chain(_chat("one", system=S)).hashes)
    memory.remember("a", chain(_chat("two", system=S)).hashes)
    again = memory.match(chain(_chat("one", "answer", "more", system=S)))
    assert again == Matches({"a": 2}, shared=1)


def test_a_branch_counts_when_one_node_matches_and_a_later_one_holds_nothing_of_it() -> None:
    memory = AffinityMemory()
    memory.remember("a", chain(_chat("one", system=S)).hashes)
    memory.remember("a", chain(_chat("two", system=S)).hashes)
    memory.remember("b", chain(_chat("elsewhere", system="other")).hashes)  # after a
    again = memory.match(chain(_chat("one", "answer", "more", system=S)))
    assert again == Matches({"a": 2}, shared=1)


def test_a_branched_block_that_ends_the_chain_is_shared() -> None:
    memory = AffinityMemory()
    memory.remember("a", chain(_chat("one", system=S)).hashes)
    memory.remember("a", chain(_chat("two", system=S)).hashes)
    # the system prompt alone: its one block has no next one to differ from
    assert memory.match(chain(_chat(system=S))) == Matches({"a": 1}, shared=1)


def test_a_block_every_node_forgot_forgets_the_block_seen_after_it() -> None:
    memory = AffinityMemory(max_per_node=10, max_total=2)
    memory.remember("a", chain(_chat("x", "y")).hashes)
    memory.remember("b", chain(_chat("q")).hashes)
    memory.remember("c", chain(_chat("r")).hashes)  # a's "x" and "y" are forgotten
    turn = chain(_chat("x", "z"))
    memory.remember("b", turn.hashes)
    # "x" followed by "z" is no branch: "x" followed by "y" was forgotten with it
    assert memory.match(turn) == Matches({"b": 2}, shared=0)


def test_a_moved_conversation_matches_longer_at_its_new_home() -> None:
    memory = AffinityMemory()
    turn1 = _chat("q1", system="s")
    turn2 = _chat("q1", "a1", "q2", system="s")
    memory.remember("a", chain(turn1).hashes)
    memory.remember("b", chain(turn2).hashes)  # a was full: b served turn 2
    found = memory.match(chain(_chat("q1", "a1", "q2", "a2", "q3", system="s")))
    assert found == Matches({"a": 2, "b": 4}, shared=2)


def test_nothing_remembered_matches_nothing() -> None:
    assert AffinityMemory().match(chain(_chat("hi"))) == Matches({}, 0)


def test_the_memory_forgets_a_node_oldest_first_and_its_latest_blocks_first() -> None:
    memory = AffinityMemory(max_per_node=4, max_total=100)
    old = chain(_chat("old", "r", "again"))
    new = chain(_chat("new", "r"))
    memory.remember("a", old.hashes)
    memory.remember("a", new.hashes)  # 5 blocks for a: its oldest, old's last, goes
    assert memory.held("a") == 4
    assert memory.match(old).blocks == {"a": 2}  # a prefix still
    assert memory.match(new).blocks == {"a": 2}
    memory.remember("b", old.hashes)  # another node's bound is its own
    assert memory.held("b") == 3
    assert len(memory) == 7


def test_the_memory_is_bounded_in_all_oldest_first_whatever_the_node() -> None:
    memory = AffinityMemory(max_per_node=10, max_total=4)
    first = chain(_chat("1", "r", "2"))
    memory.remember("a", first.hashes)
    memory.remember("b", chain(_chat("x", "y")).hashes)
    assert len(memory) == 4
    assert memory.match(first).blocks == {"a": 2}  # a's latest block went first
    memory.remember("a", first.hashes)  # remembered again: the most recent now
    assert memory.match(first).blocks == {"a": 3}
    assert memory.held("b") == 1


def test_remembering_again_adds_nothing() -> None:
    memory = AffinityMemory()
    turn = chain(_chat("same"))
    memory.remember("a", turn.hashes)
    memory.remember("a", turn.hashes)
    assert len(memory) == 1


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="bounds"):
        AffinityMemory(max_per_node=0)


# -- the choice ----------------------------------------------------------------------------


def node(
    name: str,
    in_flight: int = 0,
    capacity: int = 2,
    *,
    ready: bool = True,
    full: bool | None = None,
) -> Candidate:
    load = in_flight / max(capacity, 1)
    is_full = capacity > 0 and in_flight >= capacity if full is None else full
    return Candidate(name, ready, is_full, load, in_flight, capacity)


CHOICES: list[tuple[str, Matches, list[Candidate], str | None]] = [
    ("nothing-matched", Matches({}, 0), [node("a"), node("b")], None),
    ("longest-match", Matches({"a": 2, "b": 5}, 1), [node("a"), node("b")], "b"),
    ("one-node-matched", Matches({"b": 3}, 0), [node("a"), node("b")], "b"),
    ("match-not-a-candidate", Matches({"c": 3}, 0), [node("a"), node("b")], None),
    ("shared-opening-alone", Matches({"a": 1}, 1), [node("a"), node("b")], None),
    ("shared-by-both", Matches({"a": 3, "b": 3}, 3), [node("a"), node("b")], None),
    ("beyond-the-shared-part", Matches({"a": 4, "b": 3}, 3), [node("a"), node("b")], "a"),
    ("tie-beyond-shared", Matches({"a": 4, "b": 4}, 1), [node("a"), node("b")], None),
    # load wins over cache: full, or 0.5 more load than the least loaded
    ("home-full", Matches({"a": 4}, 0), [node("a", in_flight=2), node("b")], None),
    ("home-full-by-engine", Matches({"a": 4}, 0), [node("a", full=True), node("b")], None),
    ("load-below-margin", Matches({"a": 4}, 0), [node("a", 1, 3), node("b", 0, 3)], "a"),
    ("load-at-margin", Matches({"a": 4}, 0), [node("a", 1, 2), node("b", 0, 2)], None),
    ("load-at-margin-thirds", Matches({"a": 4}, 0), [node("a", 2, 3), node("b", 1, 6)], None),
    ("load-level", Matches({"a": 4}, 0), [node("a", 1, 2), node("b", 1, 2)], "a"),
    ("load-vs-full-other", Matches({"a": 4}, 0), [node("a", 1, 2), node("b", 2, 2)], "a"),
    ("load-vs-third", Matches({"a": 4}, 0), [node("a", 3, 4), node("b", 1, 4)], None),
    ("load-just-below", Matches({"a": 4}, 0), [node("a", 3, 5), node("b", 1, 5)], "a"),
    # capacity unknown (0): attempts in flight, 2 above the fewest
    ("unknown-one-above", Matches({"a": 4}, 0), [node("a", 1, 0), node("b", 0, 0)], "a"),
    ("unknown-two-above", Matches({"a": 4}, 0), [node("a", 2, 0), node("b", 0, 0)], None),
    ("unknown-three-vs-two", Matches({"a": 4}, 0), [node("a", 3, 0), node("b", 2, 0)], "a"),
    # never a cooling node above a ready one
    ("home-cooling", Matches({"a": 4}, 0), [node("a", ready=False), node("b")], None),
    (
        "cooling-other-ignored-for-load",
        Matches({"a": 4}, 0),
        [node("a", 1, 2), node("b", 0, 2, ready=False)],
        "a",
    ),
    (
        "all-cooling-still-preferred",
        Matches({"b": 4}, 0),
        [node("a", ready=False), node("b", ready=False)],
        "b",
    ),
    (
        "ready-shorter-beats-cooling-longer",
        Matches({"a": 6, "b": 4}, 2),
        [node("a", ready=False), node("b")],
        "b",
    ),
]


@pytest.mark.parametrize(
    ("matches", "candidates", "expected"), [c[1:] for c in CHOICES], ids=[c[0] for c in CHOICES]
)
def test_prefer(matches: Matches, candidates: list[Candidate], expected: str | None) -> None:
    assert prefer(matches, candidates) == expected


# -- the replicas' record ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("chain", "expected"),
    [
        (("00112233445566ff",), [0x00112233445566FF]),
        (("not hex at all!!",), None),
        (("0011",), None),  # not 8 bytes
        ((), None),
        (("00" * 8,) * (MAX_BLOCKS + 1), None),
    ],
    ids=["whole", "not-hex", "short", "empty", "too-long"],
)
def test_a_served_record_is_read_back_or_dropped(
    chain: tuple[str, ...], expected: list[int] | None
) -> None:
    assert Served("a", chain, origin="r2").hashes() == expected


def test_a_lone_surrogate_anywhere_hashes() -> None:
    lone = {"model": "m", "messages": [{"role": "\ud800", "content": "\udfff"}]}
    assert len(chain(lone).hashes) == 1


@pytest.mark.parametrize("content", ["hi there", "h\u00e9 l\u00e0"], ids=["ascii", "utf-8"])
def test_a_message_hashes_as_its_role_a_nul_and_its_content(content: str) -> None:
    found = chain({"model": "m", "messages": [{"role": "user", "content": content}]})
    data = b"user\0" + content.encode()
    crc = zlib.crc32(data, zlib.crc32(b"m:latest\0"))
    assert found.hashes == ((crc << 32) | len(data),)
    assert found.ends == (len(data),)
