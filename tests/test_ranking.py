"""Table-driven tests of candidate resolution and prefix affinity (trio_failover.ranking).

Every case is plain data: a ranking, the request's model, the set of nodes
cooling at the request's ``now``, an optional ``X-Failover-Node`` and an
optional affinity winner. The expected order is the one the attempts go in
(the candidates): ``resolve_candidates``' order, split by readiness at
each attempt by ``slots.choose_node``, as the proxy does. No clock, no I/O.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest

from trio_failover.core.config import Upstream
from trio_failover.core.ranking import (
    AFFINITY_PREFIX_BYTES,
    affinity_key,
    rendezvous_choice,
    resolve_candidates,
)
from trio_failover.core.slots import SlotLedger, Take, choose_node


def _node(name: str, models: Sequence[str] | Mapping[str, str] | None = None) -> Upstream:
    return Upstream(name, f"http://{name}.test:8000", models=models)


A, B, C, D = (_node(name) for name in "abcd")
# Q serves one model under its own name; M maps one name and no other; V maps
# one name and, through "*", every other name too.
Q = _node("q", ["qwen3:32b"])
M = _node("m", {"llama3": "meta-llama/Llama-3-8B"})
V = _node("v", {"qwen3:32b": "Qwen/Qwen3-32B", "*": "Qwen/Qwen3-32B"})
# S maps every name and lists none of its own (its inventory, once known,
# is what it lists); L lists llama3.2 untagged; K maps llama3.2 untagged.
S = _node("s", {"*": "Qwen/Qwen3-32B"})
L = _node("l", ["llama3.2"])
K = _node("k", {"llama3.2": "meta/llama-3.2"})
NODES = {node.name: node for node in (A, B, C, D, Q, M, V, S, L, K)}


def _key_choosing(winner: str, among: Sequence[str]) -> bytes:
    """An affinity key whose rendezvous winner over ``among`` is ``winner``."""
    for index in itertools.count():  # pragma: no branch - ends within a few tries
        key = f"test-key-{index}".encode()
        if rendezvous_choice(among, key) == winner:
            return key
    raise AssertionError("unreachable")  # pragma: no cover


@attrs.frozen
class Case:
    id: str
    ranking: str  # node names in configuration order, one letter each
    expected: str  # candidate names, best first
    model: str | None = None
    cooling: str = ""  # the nodes cooling at the request's now
    selected: str | None = None
    affinity: str | None = None  # the node the affinity key hashes to
    # node name -> its inventory (the ids of its last model list)
    inventories: dict[str, tuple[str, ...] | None] = attrs.field(factory=dict)


CASES = [
    # The immutable ranking, stably partitioned.
    Case("ranking-kept", "abcd", "abcd"),
    Case("one-cooling-goes-last", "abcd", "acdb", cooling="b"),
    Case("cooling-keep-their-order", "abcd", "bdac", cooling="ac"),
    Case("first-cooling", "abcd", "bcda", cooling="a"),
    Case("all-cooling-stay-usable", "abcd", "abcd", cooling="abcd"),
    Case("sole-candidate-ready", "a", "a"),
    Case("sole-candidate-cooling", "a", "a", cooling="a"),
    Case("empty-ranking", "", ""),
    # The model filter.
    Case("no-model-every-node", "aqmv", "aqmv"),
    Case("no-model-every-node-cooling-last", "aqmv", "amvq", cooling="q"),
    Case("list-model", "aqmv", "aqv", model="qwen3:32b"),
    Case("mapped-model", "aqmv", "amv", model="llama3"),
    Case("star-serves-any", "aqmv", "av", model="mistral"),
    Case("no-node-serves", "qm", "", model="gpt-4o"),
    Case("filtered-then-partitioned", "aqmv", "vaq", model="qwen3:32b", cooling="aq"),
    # Inventories narrow, never refuse: when some node lists
    # the name, a node without models takes it only if its inventory lists
    # it or is unknown; when no node lists it, every node configuration
    # does not exclude.
    Case("inventory-filters", "ab", "b", model="m2", inventories={"a": ("m1",), "b": ("m2",)}),
    Case("nobody-lists-it-unknown-too", "abc", "abc", model="m2", inventories={"a": ("m1",)}),
    Case(
        "listed-elsewhere-unknown-kept",
        "abc",
        "bc",
        model="m2",
        inventories={"a": ("m1",), "b": ("m2",)},
    ),
    Case("unknown-inventory-serves-all", "ab", "ab", model="m2", inventories={"a": None}),
    Case("inventory-no-model-named", "ab", "ab", inventories={"a": ("m1",), "b": ("m2",)}),
    Case(
        "inventory-nobody-lists-it-all",
        "ab",
        "ab",
        model="m3",
        inventories={"a": ("m1",), "b": ("m2",)},
    ),
    Case("empty-inventory-is-unknown", "ab", "ab", model="m3", inventories={"a": ("m1",), "b": ()}),
    Case("empty-inventory-kept-when-listed", "ab", "ab", model="m1", inventories={"a": ("m1",)}),
    Case("configured-models-win", "qa", "qa", model="qwen3:32b", inventories={"q": ("other",)}),
    Case(
        "configured-list-narrows-inventories",
        "qab",
        "qb",
        model="qwen3:32b",
        inventories={"a": ("m1",)},
    ),
    Case("configured-still-excludes", "qma", "a", model="x", inventories={"a": ("m1",)}),
    Case("star-lists-nothing-so-all", "va", "va", model="x", inventories={"v": (), "a": ("m1",)}),
    Case(
        "star-alone-lists-its-inventory",
        "as",
        "s",
        model="m1",
        inventories={"a": ("m2",), "s": ("m1",)},
    ),
    Case("star-alone-unknown-lists-nothing", "as", "as", model="m1", inventories={"a": ("m2",)}),
    Case(
        "star-alone-kept-when-another-lists",
        "sab",
        "sb",
        model="m2",
        inventories={"s": ("m1",), "a": ("m1",), "b": ("m2",)},
    ),
    Case(
        "a-demoted-node-still-lists",
        "ab",
        "a",
        model="m1",
        cooling="a",
        inventories={"a": ("m1",), "b": ("m2",)},
    ),
    Case("inventory-then-demoted", "abc", "cab", model="m", cooling="ab", inventories={}),
    Case(
        "inventory-then-partition",
        "abc",
        "cb",
        model="m2",
        cooling="b",
        inventories={"a": ("m1",), "b": ("m2",), "c": ("m2", "m1")},
    ),
    # Issue 27: names the engines serve. Ollama lists the tagged name.
    Case(
        "ollama-bare-name-is-latest",
        "ba",
        "a",
        model="llama3.2",
        inventories={"a": ("llama3.2:latest",), "b": ("qwen3:8b",)},
    ),
    Case(
        "latest-finds-a-bare-listing",
        "ba",
        "a",
        model="llama3.2:latest",
        inventories={"a": ("llama3.2",), "b": ("qwen3:8b",)},
    ),
    Case(
        "other-tag-not-folded",
        "ab",
        "b",
        model="llama3.2",
        inventories={"a": ("llama3.2:1b",), "b": ("llama3.2:latest",)},
    ),
    Case(
        "unlisted-tag-goes-to-all",
        "ab",
        "ab",
        model="llama3.2:3b",
        inventories={"a": ("llama3.2:1b",), "b": ("llama3.2:latest",)},
    ),
    Case(
        "case-not-folded", "ab", "ab", model="llama3", inventories={"a": ("Llama3",), "b": ("x",)}
    ),
    # A single-model llama-server lists its alias and serves any name.
    Case(
        "single-model-engine-any-name", "a", "a", model="gpt-4o-mini", inventories={"a": ("tiny",)}
    ),
    Case(
        "single-model-engines-any-name",
        "ab",
        "ab",
        model="gpt-4o-mini",
        inventories={"a": ("tiny",), "b": ("model.gguf",)},
    ),
    Case(
        "tiny-latest-is-the-listed-tiny",
        "ba",
        "a",
        model="tiny:latest",
        inventories={"a": ("tiny",), "b": ("model.gguf",)},
    ),
    Case(
        "an-engine-that-lists-it-first-in-group",
        "ab",
        "b",
        model="gpt-4o-mini",
        inventories={"a": ("tiny",), "b": ("gpt-4o-mini",)},
    ),
    # Configured names compare the same way (list entries and mapping keys).
    Case("configured-list-bare-matches-latest", "la", "la", model="llama3.2:latest"),
    Case("configured-key-bare-matches-latest", "ka", "ka", model="llama3.2:latest"),
    Case(
        "configured-bare-narrows-a-tagged-inventory",
        "lab",
        "lb",
        model="llama3.2:latest",
        inventories={"a": ("qwen3:8b",)},
    ),
    Case("configured-other-tag-excluded", "la", "a", model="llama3.2:1b"),
    # Manual selection: front of its own group, never above a ready node.
    Case("select-to-front", "abcd", "cabd", selected="c"),
    Case("select-first-is-no-op", "abcd", "abcd", selected="a"),
    Case("select-cooling-not-lifted", "abcd", "acdb", cooling="b", selected="b"),
    Case("select-front-of-cooling", "abcd", "adcb", cooling="bc", selected="c"),
    Case("select-ready-among-cooling", "abcd", "dbca", cooling="a", selected="d"),
    Case("select-when-all-cooling", "abcd", "cabd", cooling="abcd", selected="c"),
    Case("select-unknown-ignored", "abcd", "abcd", selected="zz"),
    Case("select-not-serving-model", "qm", "q", model="qwen3:32b", selected="m"),
    # Prefix affinity: the same rule as selection.
    Case("affinity-to-front", "abcd", "cabd", affinity="c"),
    Case("affinity-cooling-not-lifted", "abcd", "acdb", cooling="b", affinity="b"),
    Case("affinity-front-of-cooling", "abcd", "cdba", cooling="ab", affinity="b"),
    Case("affinity-when-all-cooling", "abcd", "dabc", cooling="abcd", affinity="d"),
    Case("affinity-after-model-filter", "aqmv", "vaq", model="qwen3:32b", affinity="v"),
    # Selection wins over affinity.
    Case("select-beats-affinity", "abcd", "dcab", selected="d", affinity="c"),
    Case(
        "cooling-select-after-ready-affinity",
        "abcd",
        "cbda",
        cooling="a",
        selected="a",
        affinity="c",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_resolve_candidates(case: Case) -> None:
    ranking = [NODES[name] for name in case.ranking]
    key = None
    if case.affinity is not None:
        among = [node.name for node in ranking if node.serves(case.model)]
        key = _key_choosing(case.affinity, among)
    candidates = resolve_candidates(
        ranking,
        model=case.model,
        selected=case.selected,
        affinity_key=key,
        inventories=case.inventories,
    )
    resolved = "".join(node.name for node in candidates)
    assert sorted(resolved) == sorted(case.expected)
    if not case.cooling:
        assert resolved == case.expected  # readiness moves nothing
    assert attempt_order(resolved, case.cooling) == case.expected
    assert [node.name for node in ranking] == list(case.ranking)  # never mutated


def attempt_order(resolved: str, cooling: str) -> str:
    """The nodes in the order a workload tries them, every attempt failing over."""
    ledger = SlotLedger(dict.fromkeys(resolved, 0))
    tried: list[str] = []
    for _ in resolved:
        choice = choose_node(
            list(resolved), tried=set(tried), ready=lambda name: name not in cooling, ledger=ledger
        )
        assert isinstance(choice, Take)
        tried.append(choice.node)
    return "".join(tried)


def test_affinity_hashes_over_the_model_filtered_nodes() -> None:
    # A key whose winner over the whole ranking is a node that does not serve
    # the model: affinity must pick among the nodes that do.
    ranking = [A, Q, M, V]
    for index in itertools.count():  # pragma: no branch - ends within a few tries
        key = f"filtered-{index}".encode()
        if rendezvous_choice("aqmv", key) == "q" and rendezvous_choice("amv", key) == "v":
            break
    candidates = resolve_candidates(ranking, model="llama3", affinity_key=key)
    assert [node.name for node in candidates] == ["v", "a", "m"]


def test_affinity_with_no_serving_node_is_empty() -> None:
    candidates = resolve_candidates([Q, M], model="gpt-4o", affinity_key=b"any")
    assert candidates == []


def _random_prompts(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    keys = []
    for _ in range(count):
        words = " ".join(rng.choice(["plan", "code", "why", "fix", "the", "bug"]) for _ in range(8))
        document = {
            "model": "qwen3:32b",
            "messages": [{"role": "user", "content": f"{rng.getrandbits(64):x} {words}"}],
        }
        key = affinity_key(document)
        assert key is not None
        keys.append(key)
    assert len(set(keys)) == count
    return keys


KEYS = _random_prompts(1000, seed=20260101)
FOUR = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]


def test_distinct_prefixes_spread_over_nodes() -> None:
    shares = Counter(rendezvous_choice(FOUR, key) for key in KEYS)
    assert set(shares) == set(FOUR)
    # 250 expected per node; the standard deviation is about 14.
    assert all(180 <= share <= 320 for share in shares.values()), shares


def test_one_prefix_always_maps_to_the_same_node() -> None:
    for key in KEYS[:200]:
        first = rendezvous_choice(FOUR, key)
        assert rendezvous_choice(FOUR, key) == first
        # The order the names come in does not matter, only the set.
        assert rendezvous_choice(reversed(FOUR), key) == first
        assert rendezvous_choice(sorted(FOUR, key=len), key) == first


def test_adding_a_node_moves_about_one_fifth() -> None:
    before = {key: rendezvous_choice(FOUR, key) for key in KEYS}
    after = {key: rendezvous_choice([*FOUR, "gpu-e"], key) for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert 0.12 <= len(moved) / len(KEYS) <= 0.30
    # Every key that moved, moved to the new node: no reshuffle among the old.
    assert {after[key] for key in moved} == {"gpu-e"}


def test_removing_a_node_moves_only_its_keys() -> None:
    before = {key: rendezvous_choice(FOUR, key) for key in KEYS}
    after = {key: rendezvous_choice(["gpu-a", "gpu-b", "gpu-d"], key) for key in KEYS}
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == "gpu-c"}


def test_names_sharing_a_long_prefix_both_win() -> None:
    # Node names may be 128 characters; a hash that looked at only part of
    # the name would give these two the same weight for every key.
    long_a, long_b = "n" * 64 + "-a", "n" * 64 + "-b"
    shares = Counter(rendezvous_choice([long_a, long_b], key) for key in KEYS)
    assert 400 <= shares[long_a] <= 600
    assert 400 <= shares[long_b] <= 600


def test_single_name_always_wins() -> None:
    assert {rendezvous_choice(["solo"], key) for key in KEYS[:50]} == {"solo"}


# -- affinity_key -----------------------------------------------------------------

LONG = "You are a careful assistant. " * 200  # about 5.8 KB, over the 4 KiB prefix
assert len(LONG.encode()) > AFFINITY_PREFIX_BYTES + 1000


def _chat(*contents: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    roles = itertools.cycle(["user", "assistant"])
    return messages + [
        {"role": role, "content": text} for role, text in zip(roles, contents, strict=False)
    ]


NO_KEY = [
    pytest.param(["messages"], id="not-a-dict"),
    pytest.param("hello", id="string-body"),
    pytest.param(None, id="none-body"),
    pytest.param({"model": "qwen3:32b"}, id="no-prompt"),
    pytest.param({}, id="empty-dict"),
    pytest.param({"model": "m", "messages": None, "prompt": None}, id="both-null"),
]


@pytest.mark.parametrize("document", NO_KEY)
def test_affinity_key_needs_a_prompt(document: Any) -> None:
    assert affinity_key(document) is None


SAME_KEY: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "same-request",
        {"model": "m", "prompt": "hello"},
        {"model": "m", "prompt": "hello", "stream": True, "temperature": 0.2},
    ),
    (
        "prompt-differs-after-4KiB",
        {"model": "m", "prompt": LONG + "first question"},
        {"model": "m", "prompt": LONG + "another question entirely"},
    ),
    (
        "chat-differs-after-4KiB",
        {"model": "m", "messages": _chat(LONG + "first", system="s")},
        {"model": "m", "messages": _chat(LONG + "second", system="s")},
    ),
    (
        "long-system-prompt-shared",
        {"model": "m", "messages": _chat("what is trio?", system=LONG)},
        {"model": "m", "messages": _chat("what is h11?", system=LONG)},
    ),
    (
        "next-turn-of-a-short-chat",
        {"model": "m", "messages": _chat("hi", system="be brief")},
        {"model": "m", "messages": _chat("hi", "hello!", "tell me more", system="be brief")},
    ),
    (
        "next-turn-without-system",
        {"model": "m", "messages": _chat("hi")},
        {"model": "m", "messages": _chat("hi", "hello!", "and then?")},
    ),
    (
        "key-order-irrelevant",
        {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "messages": [{"content": "x", "role": "user"}]},
    ),
    (
        "null-messages-falls-back-to-prompt",
        {"model": "m", "messages": None, "prompt": "p"},
        {"model": "m", "prompt": "p"},
    ),
    (
        "bare-name-is-latest",
        {"model": "llama3.2", "prompt": "p"},
        {"model": "llama3.2:latest", "prompt": "p"},
    ),
    (
        "messages-as-text-keyed-as-given",
        {"model": "m", "messages": "hello there"},
        {"model": "m", "prompt": "hello there"},
    ),
]


@pytest.mark.parametrize(
    ("first", "second"), [(a, b) for _, a, b in SAME_KEY], ids=[i for i, _, _ in SAME_KEY]
)
def test_affinity_key_same(first: dict[str, Any], second: dict[str, Any]) -> None:
    key = affinity_key(first)
    assert key is not None
    assert affinity_key(second) == key


DIFFERENT_KEY: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("other-model", {"model": "a", "prompt": "p"}, {"model": "b", "prompt": "p"}),
    ("other-tag", {"model": "a", "prompt": "p"}, {"model": "a:1b", "prompt": "p"}),
    ("other-prompt", {"model": "m", "prompt": "p"}, {"model": "m", "prompt": "q"}),
    (
        "differs-inside-4KiB",
        {"model": "m", "prompt": "x" + LONG},
        {"model": "m", "prompt": "y" + LONG},
    ),
    (
        "other-first-question",
        {"model": "m", "messages": _chat("what is trio?", system="s")},
        {"model": "m", "messages": _chat("what is h11?", system="s")},
    ),
    (
        "other-system-prompt",
        {"model": "m", "messages": _chat("q", system="be brief")},
        {"model": "m", "messages": _chat("q", system="be thorough")},
    ),
    (
        "no-user-message-keys-on-all",
        {"model": "m", "messages": _chat(system="one")},
        {"model": "m", "messages": _chat(system="two")},
    ),
    (
        "messages-win-over-prompt",
        {"model": "m", "messages": _chat("a"), "prompt": "same"},
        {"model": "m", "messages": _chat("b"), "prompt": "same"},
    ),
]


@pytest.mark.parametrize(
    ("first", "second"),
    [(a, b) for _, a, b in DIFFERENT_KEY],
    ids=[i for i, _, _ in DIFFERENT_KEY],
)
def test_affinity_key_different(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert affinity_key(first) != affinity_key(second)


@pytest.mark.parametrize(
    "document",
    [
        {"model": "m", "prompt": LONG},
        {"model": "m", "messages": _chat(LONG)},
        {"model": "m", "prompt": "\u00e9" * 5000},  # two bytes each: the cut may split one
        {"model": "m", "prompt": ["a list", "of prompts"]},
        {"model": "m", "prompt": "\ud800 lone surrogate from a JSON escape"},
    ],
    ids=["long-prompt", "long-chat", "multibyte-cut", "prompt-list", "lone-surrogate"],
)
def test_affinity_key_is_bounded_bytes(document: dict[str, Any]) -> None:
    key = affinity_key(document)
    assert isinstance(key, bytes)
    assert key.startswith(b"m:latest\0")  # the model as names.model_key spells it
    assert len(key) <= len(b"m:latest\0") + AFFINITY_PREFIX_BYTES
