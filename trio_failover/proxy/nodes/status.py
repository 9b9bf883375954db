"""The JSON forms of the books: ``GET /status``, recent workloads, events.

``StatusView`` reads what the node board (``board.py``), the slot queue and
``Report`` keep (node state and counters, cooldowns, the slot ledger, the
finished and live workloads) and
builds the JSON only when asked. Nothing here writes the books.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from ...core.config import Config, LiveConfig, live_config, redact_url
from ...core.inventory import DOWN_REASON, advertised_ids
from ...core.version import __version__
from ..records import ms

if TYPE_CHECKING:
    from ..records import Workload
    from .affinity import CacheAffinity
    from .board import NodeBoard
    from .queue import SlotQueue


class StatusView:
    """Builds ``/status`` and the recent workloads' list from the books."""

    def __init__(
        self,
        config: Config | LiveConfig,
        board: NodeBoard,
        queue: SlotQueue,
        recent: deque[tuple[Workload, float]],
        live: dict[int, Workload],
        limits_hit: dict[str, int] | None = None,
    ) -> None:
        self._settings = live_config(config)
        self.board = board
        self.queue = queue
        self._recent = recent  # finished workloads and when they ended
        self._live = live  # workloads not finished yet, oldest first
        self._limits_hit = {} if limits_hit is None else limits_hit  # the report's, per client
        # Cache affinity's counts per node (set by the proxy); None: no ``affinity`` field.
        self.affinity: CacheAffinity | None = None

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def recent(self) -> list[dict[str, Any]]:
        """The last finished workloads, oldest first, in their ``/status`` form."""
        return [work.summary(ended) for work, ended in self._recent]

    def document(self) -> dict[str, Any]:
        """The ``GET /status`` document."""
        now = trio.current_time()
        board = self.board
        board.expire(now)
        ledger = self.queue.scheduler.ledger
        nodes = []
        affinity = self.affinity
        for node in self.config.upstreams:
            entry = board.cooldown(node.name, now)
            known = board.nodes[node.name]
            state, reason = ("cooling", entry.reason) if entry else ("ready", None)
            if known.down:  # the graver news: its last check could not reach it
                state, reason = "down", known.down_reason or DOWN_REASON
            models = advertised_ids(node.models, known.inventory)
            nodes.append(
                {
                    "name": node.name,
                    "url": redact_url(node.url),
                    "state": state,
                    "cooldown_remaining_s": round(entry.remaining(now), 3) if entry else 0,
                    "reason": reason,
                    "models_cooling": {
                        model: {"remaining_s": round(cool.remaining(now), 3), "reason": cool.reason}
                        for model, cool in board.model_cooldowns.of_node(node.name, now).items()
                    },
                    "in_flight": ledger.fleet_in_flight(node.name),  # every replica's
                    "capacity": ledger.capacity(node.name),  # auto: as resolved now
                    "served": known.served,
                    "failed": known.failed,
                    **({} if affinity is None else {"affinity": affinity.status(node.name)}),
                    "models": list(models) if models is not None else None,
                    "last_outcome": known.last_outcome,
                    "last_error": known.last_error,
                    "last_check": (
                        known.last_check.to_json(now) if known.last_check is not None else None
                    ),
                }
            )
        finished = [(work, work.summary(ended)) for work, ended in self._recent]
        live = [(work, work.summary(now)) for work in self._live.values()]
        # Each with its age (since it started), finished or not: the
        # dashboard lists them by start, newest first, whatever their state
        # (a workload stuck at a node started before the ones that finished
        # meanwhile, and perhaps before the page was opened).
        workloads = [
            {**summary, "age_ms": ms(now - work.started)} for work, summary in [*finished, *live]
        ]
        return {
            "version": __version__,
            "queued": len(self.queue),
            "nodes": nodes,
            "workloads": workloads,
            # Per client that has any: the requests its rpm or tpm refused.
            "clients": {
                name: {"limits_hit": hits} for name, hits in sorted(self._limits_hit.items())
            },
        }
