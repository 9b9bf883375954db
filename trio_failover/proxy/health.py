"""The nodes' health and inventories, as checks and attempts leave them (SPEC 5a).

``HealthBooks`` holds, per node, what ``/status`` shows beside the counters
(down or not, the inventory, the last outcome and error), the node's last
``/api/tags`` answer (``known_tags``: the fleet's ``/api/tags`` is served
from it), how many of this proxy's attempts are streaming from it now (a
slow check of a streaming node is no sign of death), and the event a
stale-inventory ``404`` sets to have the node checked again at once. The decisions are
``core/inventory.py``'s; this module only keeps their results.
``Report`` owns one and writes the telemetry of each change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import trio

from ..core.inventory import CheckVerdict, Health


@attrs.define
class NodeHealth:
    """One node's health, inventory and last news."""

    down: bool = False
    inventory: tuple[str, ...] | None = None
    # The entries of its last /api/tags answer; None: it gave none (yet).
    tags: list[dict[str, object]] | None = None
    last_outcome: str | None = None
    last_error: str | None = None
    streams: int = 0  # this proxy's committed attempts relaying from it now
    last_stream_end: float = -math.inf
    # Set to ask the node's checker for a check now; replaced as a check begins.
    recheck: trio.Event = attrs.Factory(trio.Event)


class HealthBooks:
    """Every node's ``NodeHealth``, by name."""

    def __init__(self, names: Iterable[str]) -> None:
        self.nodes = {name: NodeHealth() for name in names}
        # Only the nodes with an inventory: what ranking filters on, and
        # empty (nothing to parse a body for) until a check lists models.
        self.inventories: dict[str, tuple[str, ...]] = {}

    def is_down(self, name: str) -> bool:
        """Whether the node's last health check failed (and nothing served since)."""
        return self.nodes[name].down

    def down_count(self) -> int:
        """How many nodes are down now."""
        return sum(node.down for node in self.nodes.values())

    def apply_check(self, name: str, verdict: CheckVerdict) -> Health:
        """Keep what a finished check says; returns the health change (UNCHANGED: none)."""
        node = self.nodes[name]
        node.last_outcome = f"check_{verdict.result}"
        if verdict.last_error is not None:
            node.last_error = verdict.last_error
        if verdict.replace_inventory:
            node.inventory = verdict.inventory
            if verdict.inventory:
                self.inventories[name] = verdict.inventory
            else:
                self.inventories.pop(name, None)
        return self._set_health(node, verdict.health)

    def keep_tags(self, name: str, entries: list[dict[str, object]] | None) -> None:
        """Keep the node's answer to a check's ``GET /api/tags`` (None: not a tags answer)."""
        self.nodes[name].tags = entries

    def known_tags(self, name: str) -> list[dict[str, object]] | None:
        """The ``models`` entries of the node's last ``/api/tags`` answer to a check.

        None while the node has given none: discovery is off, no check has
        asked yet, or its last answer was not a tags list (a ``404`` from an
        engine without the route). A check that got no answer at all
        (timeout, refused) keeps the answer before it. The entries are the
        node's own; do not change them.
        """
        return self.nodes[name].tags

    def served(self, name: str) -> Health:
        """A committed attempt: a down node is ready again; returns the change."""
        return self._set_health(self.nodes[name], Health.READY)

    def attempt_ended(self, name: str, outcome: str, error: str | None) -> None:
        """Keep the outcome (and error, if any) of an attempt or stream at the node."""
        node = self.nodes[name]
        node.last_outcome = outcome
        if error is not None:
            node.last_error = error

    @staticmethod
    def _set_health(node: NodeHealth, health: Health) -> Health:
        if health is Health.DOWN and not node.down:
            node.down = True
            return Health.DOWN
        if health is Health.READY and node.down:
            node.down = False
            return Health.READY
        return Health.UNCHANGED

    # -- streams and re-checks -----------------------------------------------

    def streaming(self, name: str) -> _Streaming:
        """Count a committed attempt of ``name`` as streaming while the ``with`` block runs."""
        return _Streaming(self.nodes[name])

    def streamed_since(self, name: str, since: float) -> bool:
        """Whether an attempt of ``name`` streamed at any moment from ``since`` on."""
        node = self.nodes[name]
        return node.streams > 0 or node.last_stream_end >= since

    def ask_recheck(self, name: str) -> None:
        """Have the node's checker check it now (or right after its running check)."""
        self.nodes[name].recheck.set()

    def take_recheck(self, name: str) -> trio.Event:
        """A fresh re-check event for a check that begins now; a later ask sets it."""
        event = self.nodes[name].recheck = trio.Event()
        return event


class _Streaming:
    """``HealthBooks.streaming``: a class, not a generator, as it runs on every request."""

    __slots__ = ("node",)

    def __init__(self, node: NodeHealth) -> None:
        self.node = node

    def __enter__(self) -> None:
        self.node.streams += 1

    def __exit__(self, *_exc: object) -> None:
        self.node.streams -= 1
        self.node.last_stream_end = trio.current_time()
