"""Whether each node takes requests: its cooldown, its down flag, and the news.

``Readiness`` keeps the cooldown table, applies finished health checks to
the health books, holds the one readiness predicate (``is_demoted``) that
the slot queue asks, and tells every change: the ``cooling``, ``down`` and
``ready`` node events, their log lines and the gauges (also the slot
queue's: ``in_flight``, ``queue_length``). ``Report`` owns one as
``report.readiness``; the shell calls it there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import trio

from ..core.config import Config
from ..core.cooldown import CooldownTable
from ..core.inventory import DOWN_REASON, READY_REASON_CHECK, CheckVerdict, Health
from ..telemetry.events import EventBus
from ..telemetry.logs import logger
from ..telemetry.metrics import Metrics
from .health import HealthBooks
from .queue import SlotQueue


class Readiness:
    """The nodes' cooldowns and down flags, and the slot queue that asks them."""

    def __init__(
        self, config: Config, health: HealthBooks, events: EventBus, metrics: Metrics
    ) -> None:
        self.cooldowns = CooldownTable()
        self.health = health
        self.events = events
        self.metrics = metrics
        # Slots from connect to the end of the relay: in_flight of SPEC 2.
        self.queue = SlotQueue(config, self.is_demoted)
        self.watch_in_flight(node.name for node in config.upstreams)
        metrics.queue_length.set_function(self.queue.__len__)

    def watch_in_flight(self, nodes: Iterable[str]) -> None:
        """Have the ``in_flight`` gauge of ``nodes`` read the slot ledger at scrape time."""
        ledger = self.queue.scheduler.ledger
        for node in nodes:
            # Read at scrape time: no gauge update per attempt.
            self.metrics.in_flight.labels(node).set_function(partial(ledger.in_flight, node))

    # -- cooldowns -----------------------------------------------------------

    def demote(self, node: str, duration: float, reason: str, now: float) -> None:
        """Cool ``node`` down for ``duration`` seconds from ``now``."""
        entry = self.cooldowns.demote(node, now=now, duration=duration, reason=reason)
        self.metrics.child(self.metrics.cooldowns, node, reason).inc()
        self.metrics.cooling.set(len(self.cooldowns.active(now)))
        self.queue.demoted()
        until = round(entry.remaining(now), 3)
        logger.warning(
            "cooldown", extra={"fields": {"node": node, "reason": reason, "for_s": until}}
        )
        self.events.publish(
            {"type": "node", "node": node, "state": "cooling", "reason": reason, "until_s": until}
        )

    def expire_cooldowns(self, now: float | None = None) -> None:
        """Notice cooldowns that ran out (publishing ``ready`` node events)."""
        if now is None:
            now = trio.current_time()
        ended = self.cooldowns.expire(now)
        if ended:  # asked at every workload: the common answer costs nothing
            for entry in ended:
                if not self.health.is_down(entry.node):  # else "ready" would be false news
                    self.node_ready(entry.node, "expired")
            self.metrics.cooling.set(len(self.cooldowns.active(now)))
            self.queue.dispatch()

    def queue_wake_at(self) -> float:
        """When a cooldown next ends while workloads wait (else ``inf``), for the ticker."""
        # active(-inf): every entry, also those that ran out but were not
        # noticed yet; their end lies in the past, so the ticker looks now.
        return self.queue.wake_at(entry.until for entry in self.cooldowns.active(-math.inf))

    # -- health checks (SPEC 5a) ---------------------------------------------

    def is_demoted(self, name: str, now: float) -> bool:
        """Whether ``name`` is demoted behind the ready nodes at ``now``: cooling or down.

        The one readiness predicate: the slot queue asks this (and nothing
        else) at each attempt, to put ready nodes before demoted ones. Every
        change of its answer other than a cooldown's expiry must call
        ``self.queue.dispatch()`` (waiters may use other nodes then); the
        ticker sees to expiries.
        """
        return self.cooldowns.is_cooling(name, now) or self.health.is_down(name)

    def check_finished(self, node: str, verdict: CheckVerdict, now: float) -> None:
        """Keep a finished health check's verdict; tell of a node going down or coming back."""
        change = self.health.apply_check(node, verdict)
        self.metrics.child(self.metrics.checks, node, verdict.result).inc()
        if change is Health.DOWN:
            fields = {"node": node, "reason": DOWN_REASON, "error": verdict.last_error}
            logger.warning("node down", extra={"fields": fields})
            self.events.publish(
                {"type": "node", "node": node, "state": "down", "reason": DOWN_REASON, "until_s": 0}
            )
        elif change is Health.READY and not self.cooldowns.is_cooling(node, now):
            self.node_ready(node, READY_REASON_CHECK)
        if change is not Health.UNCHANGED:  # waiters may use other nodes now
            self.queue.dispatch()
        self.metrics.down.set(self.health.down_count())

    def node_ready(self, node: str, reason: str) -> None:
        """Tell that ``node`` takes requests again."""
        logger.info("node ready", extra={"fields": {"node": node, "reason": reason}})
        self.events.publish(
            {"type": "node", "node": node, "state": "ready", "reason": reason, "until_s": 0}
        )
