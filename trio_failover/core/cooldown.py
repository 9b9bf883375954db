"""Pure: which nodes are demoted, why, and until when.

Two rules hold for the whole table:

1. A cooldown *demotes* a node behind its ready peers; it never excludes it
   (that is ``ranking.py``'s business, this table only answers "cooling?").
2. A cooldown ends by expiry or by a successful response from the node
   (``ends_cooldown``), whichever comes first. Expiry is computed from ``now`` when asked: there
   is no timer task per node, so the table works the same under a mock clock.
"""

from __future__ import annotations

import attrs


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
