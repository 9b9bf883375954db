"""Pure: the candidates for one request, best first.

The ranking from configuration is immutable. For each request it is
resolved in two steps, each a plain function of data:

1. model filter (``model_filter``): a node with ``models``
   only takes requests naming one of them (or any, with ``"*"``); a node
   without is narrowed by its inventory, but only when some node lists the
   name: inventories narrow, they never refuse a name an engine would
   serve. A request that names no model goes to every node. Names compare
   as Ollama resolves them (``names.py``);
2. manual selection (``X-Failover-Node``) moves the named node to the front.

Cache affinity (``affinity.py``) names the node a request prefers, which
the slot queue tries first while load allows; it does not reorder here.

Readiness is not applied here. The stable partition (ready nodes
first, demoted ones after, each group in this order) is taken at each
attempt by ``slots.choose_node``, so that a node that recovers while
a workload waits or fails over regains its place. Because the partition
comes last, neither cache affinity nor a manual selection can lift a demoted
node above a ready one; demotion never excludes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .config import Upstream
from .inventory import Inventory, lists_model
from .names import accepts, find_name


def resolve_candidates(
    ranking: Sequence[Upstream],
    *,
    model: str | None,
    selected: str | None = None,
    inventories: Mapping[str, Inventory] | None = None,
) -> list[Upstream]:
    """The nodes to try for one request, in order.

    Args:
        ranking: all nodes in configuration order.
        model: the ``"model"`` of the request body, if any.
        selected: the node named by ``X-Failover-Node``, if any.
        inventories: the known inventories by node name (discovery's); a node
            missing from it, or with None, has none yet.

    Returns:
        The candidates, not partitioned by readiness (``choose_node`` does
        that at each attempt). Empty only when no node serves ``model``.
    """
    nodes = model_filter(ranking, model, inventories or {})
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
