"""Table-driven tests of candidate resolution (trio_failover.ranking).

Every case is plain data: a ranking, the request's model, the set of nodes
cooling at the request's ``now`` and an optional ``X-Failover-Node``. The
expected order is the one the attempts go in (the candidates):
``resolve_candidates``' order, split by readiness at each attempt by
``slots.choose_node``, as the proxy does. No clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import pytest

from trio_failover.core.config import Upstream
from trio_failover.core.ranking import resolve_candidates
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


@attrs.frozen
class Case:
    id: str
    ranking: str  # node names in configuration order, one letter each
    expected: str  # candidate names, best first
    model: str | None = None
    cooling: str = ""  # the nodes cooling at the request's now
    selected: str | None = None
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
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_resolve_candidates(case: Case) -> None:
    ranking = [NODES[name] for name in case.ranking]
    candidates = resolve_candidates(
        ranking,
        model=case.model,
        selected=case.selected,
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
