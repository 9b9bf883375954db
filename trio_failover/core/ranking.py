"""Pure: the candidates for one request, best first.

The ranking from configuration is immutable. For each request it is
resolved in three steps, each a plain function of data:

1. model filter (``model_filter``): a node with ``models``
   only takes requests naming one of them (or any, with ``"*"``); a node
   without is narrowed by its inventory, but only when some node lists the
   name: inventories narrow, they never refuse a name an engine would
   serve. A request that names no model goes to every node. Names compare
   as Ollama resolves them (``names.py``);
2. prefix affinity (``--affinity prefix``): rendezvous hashing of the model
   and the start of the prompt moves one node to the front;
3. manual selection (``X-Failover-Node``) moves the named node to the front.

Readiness is not applied here. The stable partition (ready nodes
first, demoted ones after, each group in this order) is taken at each
attempt by ``slots.choose_node``, so that a node that recovers while
a workload waits or fails over regains its place. Because the partition
comes last, neither affinity nor a manual selection can lift a demoted
node above a ready one; demotion never excludes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .config import Upstream
from .inventory import Inventory, lists_model
from .names import accepts, find_name, model_key

# How much of the prompt identifies a conversation for KV-cache affinity.
# System prompt and first turns fit in it; a growing chat keeps its prefix.
AFFINITY_PREFIX_BYTES = 4096


def resolve_candidates(
    ranking: Sequence[Upstream],
    *,
    model: str | None,
    selected: str | None = None,
    affinity_key: bytes | None = None,
    inventories: Mapping[str, Inventory] | None = None,
) -> list[Upstream]:
    """The nodes to try for one request, in order.

    Args:
        ranking: all nodes in configuration order.
        model: the ``"model"`` of the request body, if any.
        selected: the node named by ``X-Failover-Node``, if any.
        affinity_key: from ``affinity_key()``, when prefix affinity is on.
        inventories: the known inventories by node name (discovery's); a node
            missing from it, or with None, has none yet.

    Returns:
        The candidates, not partitioned by readiness (``choose_node`` does
        that at each attempt). Empty only when no node serves ``model``.
    """
    nodes = model_filter(ranking, model, inventories or {})
    if affinity_key is not None and nodes:
        nodes = _to_front(nodes, rendezvous_choice([n.name for n in nodes], affinity_key))
    if selected is not None:
        nodes = _to_front(nodes, selected)
    return nodes


def model_filter(
    ranking: Sequence[Upstream], model: str | None, inventories: Mapping[str, Inventory]
) -> list[Upstream]:
    """The nodes that may serve ``model``, in ranking order.

    Configuration excludes: a node with ``models`` is kept only when they
    take the name (``names.accepts``: either spelling, or ``"*"``). The
    inventories narrow, never refuse: when some kept node *lists* the name
    (``inventory.lists_model``: its configured names, or its inventory),
    a node without ``models`` stays only if its inventory lists it or is
    unknown; when no node lists it, every kept node stays, for a
    single-model llama-server or llama-cpp-python serves any name, and a
    node's ``404`` model-not-found moves the workload on.

    Args:
        ranking: all nodes in configuration order.
        model: the request's ``"model"`` (None: every node).
        inventories: the known inventories by node name; missing, None or
            empty: unknown.
    """
    if model is None:
        return list(ranking)
    kept: list[Upstream] = []
    unlisted: set[int] = set()  # indexes in kept of nodes whose inventory misses the name
    listed = False
    for node in ranking:
        inventory = inventories.get(node.name)
        if node.models is not None:
            if not accepts(model, node.models):
                continue
            listed = listed or lists_model(model, node.models, inventory)
        elif inventory:
            if find_name(model, inventory) is None:
                unlisted.add(len(kept))
            else:
                listed = True
        kept.append(node)
    if not listed or not unlisted:
        return kept
    return [node for index, node in enumerate(kept) if index not in unlisted]


def _to_front(nodes: list[Upstream], name: str) -> list[Upstream]:
    chosen = [node for node in nodes if node.name == name]
    return chosen + [node for node in nodes if node.name != name]


def rendezvous_choice(names: Iterable[str], key: bytes) -> str:
    """Highest-random-weight choice of one name for ``key``.

    Adding or removing a node moves only the keys whose winner changes,
    about 1/N of them, unlike ``hash(key) % N`` which moves almost all.
    """
    return max(names, key=lambda name: _weight(name, key))


def _weight(name: str, key: bytes) -> int:
    # The name is hashed as data, length-prefixed, not passed as blake2b's
    # key: that key holds only 64 bytes, so two names sharing their first 64
    # bytes would always tie and the later one could never win.
    encoded = name.encode()
    digest = hashlib.blake2b(digest_size=8, person=b"trio-fo")
    digest.update(len(encoded).to_bytes(4, "big"))
    digest.update(encoded)
    digest.update(key)
    return int.from_bytes(digest.digest(), "big")


def affinity_key(document: Any) -> bytes | None:
    """A stable key from a request's model and the start of its prompt.

    Understands the OpenAI chat (``messages``) and completion (``prompt``)
    shapes, which Ollama, vLLM, llama-server and LM Studio all accept. For a
    chat, only its opening (up to the first user message) counts, so every
    turn of one conversation gets the same key.
    Returns None when the body has no prompt to key on.
    """
    if not isinstance(document, dict):
        return None
    model = document.get("model")
    prompt: Any = document.get("messages")
    if isinstance(prompt, list):
        prompt = _opening(prompt)
    elif prompt is None:
        prompt = document.get("prompt")
    if prompt is None:
        return None
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    prefix = text.encode("utf-8", "surrogatepass")[:AFFINITY_PREFIX_BYTES]
    if isinstance(model, str):
        model = model_key(model)  # llama3 and llama3:latest: one model, one key
    return f"{model}\0".encode() + prefix


def _opening(messages: list[Any]) -> list[Any]:
    # Each turn of a chat resends the whole history, longer every time. A key
    # from the whole (short) history would change with every turn and send
    # the next turn away from the node that holds its KV cache; the messages
    # up to the first user message never change within one conversation.
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return messages[: index + 1]
    return messages
