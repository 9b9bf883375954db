"""The JSON forms of the books: ``GET /status`` (SPEC 6), recent workloads, events.

``StatusView`` reads what ``Report`` and ``Readiness`` keep (node counters,
cooldowns, health, the slot ledger, the finished and live workloads) and
builds the JSON only when asked; ``workload_event`` is a workload's
``workload`` event. Nothing here writes the books.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from ..core.config import Config, redact_url
from ..core.inventory import DOWN_REASON, advertised_ids
from ..core.version import __version__
from .readiness import Readiness

if TYPE_CHECKING:
    from .records import NodeStats, Workload


class StatusView:
    """Builds ``/status`` and the recent workloads' list from the books."""

    def __init__(
        self,
        config: Config,
        readiness: Readiness,
        stats: dict[str, NodeStats],
        recent: deque[tuple[Workload, float]],
        live: dict[int, Workload],
    ) -> None:
        self.config = config
        self.readiness = readiness
        self.stats = stats
        self._recent = recent  # finished workloads and when they ended
        self._live = live  # workloads not finished yet, oldest first

    def recent(self) -> list[dict[str, Any]]:
        """The last finished workloads, oldest first, in their ``/status`` form."""
        return [work.summary(ended) for work, ended in self._recent]

    def document(self) -> dict[str, Any]:
        """The ``GET /status`` document (SPEC 6)."""
        now = trio.current_time()
        readiness = self.readiness
        readiness.expire_cooldowns(now)
        nodes = []
        for node in self.config.upstreams:
            entry = readiness.cooldowns.get(node.name, now)
            stats = self.stats[node.name]
            ledger = readiness.queue.scheduler.ledger
            health = readiness.health.nodes[node.name]
            state, reason = ("cooling", entry.reason) if entry else ("ready", None)
            if health.down:  # the graver news: its last check could not reach it
                state, reason = "down", DOWN_REASON
            models = advertised_ids(node.models, health.inventory)
            nodes.append(
                {
                    "name": node.name,
                    "url": redact_url(node.url),
                    "state": state,
                    "cooldown_remaining_s": round(entry.remaining(now), 3) if entry else 0,
                    "reason": reason,
                    "in_flight": ledger.in_flight(node.name),
                    "capacity": ledger.capacity(node.name),  # auto: as resolved now
                    "served": stats.served,
                    "failed": stats.failed,
                    "models": list(models) if models is not None else None,
                    "last_outcome": health.last_outcome,
                    "last_error": health.last_error,
                    "last_check": (
                        stats.last_check.to_json(now) if stats.last_check is not None else None
                    ),
                }
            )
        live = [work.summary(now) for work in self._live.values()]
        return {
            "version": __version__,
            "queued": len(readiness.queue),
            "nodes": nodes,
            "workloads": self.recent() + live,
        }


def workload_event(work: Workload, position: int | None) -> dict[str, Any]:
    """The ``workload`` event of ``work``'s current state.

    ``position``: its place in the queue as it starts waiting (1 = next).
    """
    event: dict[str, Any] = {
        "type": "workload",
        "id": work.id,
        "state": str(work.state),
        "node": work.node,
        "attempt": work.attempt,
        "method": work.method,
        "path": work.path,
        "client": work.client,
        "model": work.model,
    }
    if work.status is not None:
        event["status"] = work.status
    if position is not None:
        event["position"] = position
    return event
