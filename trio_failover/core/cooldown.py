"""Pure: which nodes are demoted, why, and until when.

Two rules hold for the whole table:

1. A cooldown *demotes* a node behind its ready peers; it never excludes it
   (that is ``ranking.py``'s business, this table only answers "cooling?").
2. A cooldown ends by expiry or by a successful response from the node
   (``ends_cooldown``), whichever comes first. Expiry is computed from ``now`` when asked: there
   is no timer task per node, so the table works the same under a mock clock.
"""

from __future__ import annotations

import math

import attrs

from .names import spellings


def ends_cooldown(status: int) -> bool:
    """Whether a committed answer with ``status`` ends its node's cooldown early.

    A cooldown is for a node that stalled. One that answers promptly with a
    client error (``400``, ``404``...) is alive: the error is the request's,
    as nginx and Envoy count it, so any status below 500 ends the cooldown.
    A relayed 5xx (one not in retry-status) is the node's own failure and
    proves nothing: the cooldown runs on (docs/failover.md).
    """
    return status < 500


@attrs.frozen
class Cooldown:
    """One node's demotion: from ``since`` until ``until`` (Trio clock seconds)."""

    node: str
    reason: str
    since: float
    until: float

    def remaining(self, now: float) -> float:
        """Seconds left at ``now`` (0 once expired)."""
        return max(0.0, self.until - now)


class CooldownTable:
    """The demoted nodes of one proxy. Process-local by design."""

    def __init__(self) -> None:
        self._entries: dict[str, Cooldown] = {}

    def demote(self, node: str, *, now: float, duration: float, reason: str) -> Cooldown:
        """Demote ``node`` for ``duration`` seconds from ``now``.

        A node already cooling keeps the longer of the two demotions, so a
        short ``Retry-After`` never shortens a stall's cooldown. The kept
        entry stays whole: its reason is the one that explains its end time.

        Returns:
            The node's cooldown after this call (possibly the earlier one).
        """
        current = self._entries.get(node)
        if current is not None and current.until > now + duration:
            return current
        entry = Cooldown(node=node, reason=reason, since=now, until=now + duration)
        self._entries[node] = entry
        return entry

    def restore(self, node: str) -> Cooldown | None:
        """End ``node``'s cooldown early (it served a response); returns what ended."""
        return self._entries.pop(node, None)

    def get(self, node: str, now: float) -> Cooldown | None:
        """The node's cooldown if it is still running at ``now``."""
        entry = self._entries.get(node)
        if entry is None or entry.until <= now:
            return None
        return entry

    def is_cooling(self, node: str, now: float) -> bool:
        """Whether ``node`` is demoted at ``now``."""
        return self.get(node, now) is not None

    def expire(self, now: float) -> list[Cooldown]:
        """Drop and return the cooldowns that have run out by ``now``."""
        ended = [entry for entry in self._entries.values() if entry.until <= now]
        for entry in ended:
            del self._entries[entry.node]
        return ended

    def active(self, now: float) -> list[Cooldown]:
        """The cooldowns still running at ``now``."""
        return [entry for entry in self._entries.values() if entry.until > now]


class ModelCooldowns:
    """The per-model demotions of one proxy's nodes: node x model -> ``Cooldown``.

    A node that serves more than one model may stall on one (its load, its
    prompt) and serve the others: such a demotion is kept here, by the
    model's name as first demoted (a later spelling of the same model,
    ``llama3`` for ``llama3:latest``, finds it: ``names.spellings``), beside
    the node-wide ``CooldownTable``.
    ``by_model`` (read it, never write it) is empty while no model of any
    node cools: the request path tests it, a plain dict, before anything else.
    """

    def __init__(self) -> None:
        self.by_model: dict[str, CooldownTable] = {}

    def key(self, model: str) -> str:
        """The spelling ``model`` is kept under: the one already kept, else its own."""
        for name in spellings(model):
            if name in self.by_model:
                return name
        return model

    def demote(
        self, node: str, model: str, *, now: float, duration: float, reason: str
    ) -> Cooldown:
        """Demote ``node`` for ``model`` (the longer demotion wins, as ``CooldownTable``)."""
        table = self.by_model.setdefault(self.key(model), CooldownTable())
        return table.demote(node, now=now, duration=duration, reason=reason)

    def get(self, node: str, model: str, now: float) -> Cooldown | None:
        """The cooldown of ``node`` for ``model`` still running at ``now``."""
        table = self.by_model.get(self.key(model))
        return None if table is None else table.get(node, now)

    def restore(self, node: str, model: str) -> Cooldown | None:
        """End the cooldown of ``node`` for ``model``; returns what ended."""
        model = self.key(model)
        table = self.by_model.get(model)
        if table is None:
            return None
        ended = table.restore(node)
        if not table.active(-math.inf):
            del self.by_model[model]
        return ended

    def forget(self, node: str) -> None:
        """Drop every model cooldown of ``node`` (it left the fleet)."""
        for model in list(self.by_model):
            self.restore(node, model)

    def expire(self, now: float) -> list[tuple[str, Cooldown]]:
        """Drop and return the ``(model, cooldown)`` pairs that ran out by ``now``."""
        ended = [
            (model, entry) for model, table in self.by_model.items() for entry in table.expire(now)
        ]
        for model in [
            model for model, table in self.by_model.items() if not table.active(-math.inf)
        ]:
            del self.by_model[model]
        return ended

    def of_node(self, node: str, now: float) -> dict[str, Cooldown]:
        """The models of ``node`` cooling at ``now`` (``/status``'s ``models_cooling``)."""
        found = {}
        for model, table in self.by_model.items():
            entry = table.get(node, now)
            if entry is not None:
                found[model] = entry
        return found

    def ends(self) -> list[float]:
        """When each kept cooldown ends (expired ones included), for the ticker."""
        return [
            entry.until for table in self.by_model.values() for entry in table.active(-math.inf)
        ]
