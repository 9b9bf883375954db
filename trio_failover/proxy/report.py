"""What the proxy tells about its work: node counters, cooldowns, recent
workloads, and the events, metrics and log lines they make.

``Report`` is the one place that writes them; the workload shell
(``workload.py``) calls it at each milestone, and the admin API and the demo
read ``status()``, ``recent`` and ``events`` from it (through ``Proxy``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from functools import partial
from typing import Any

import attrs
import trio

from .. import __version__
from ..core.config import Config, redact_url
from ..core.cooldown import CooldownTable
from ..core.inventory import DOWN_REASON, READY_REASON_CHECK, CheckVerdict, Health, advertised_ids
from ..core.outcome import AttemptRecord, Outcome, ends_cooldown
from ..core.workload import State, transition
from ..service.events import EventBus
from ..service.logs import access_logger, log_access, logger
from ..service.metrics import Metrics
from ..wire.client import Closed
from .health import HealthBooks
from .queue import SlotQueue

RECENT_WORKLOADS = 50
# The ``client`` label of the workloads metric when no key is configured
# (with keys, every workload has its key's name; the two never mix).
ANONYMOUS = "anonymous"


@attrs.define
class NodeStats:
    """Counters of one node, as ``/status`` shows them (``in_flight``: the slot ledger)."""

    served: int = 0
    failed: int = 0


def _checked_move(work: Workload, _attribute: Any, new: State) -> State:
    # Every assignment of ``state`` goes through the transition table.
    return transition(work.state, new)


@attrs.define
class Workload:
    """One client request across all its attempts."""

    id: str
    method: str
    path: str
    started: float
    attempts: list[AttemptRecord] = attrs.Factory(list)
    node: str | None = None  # the node of the current (or serving) attempt
    attempt: int = 0  # the number of the current attempt, from 1
    attempt_started: float = 0.0
    committed_at: float | None = None
    state: State = attrs.field(default=State.QUEUED, on_setattr=_checked_move)
    status: int | None = None
    body_bytes: int = 0
    client_left: Closed | None = None
    client: str | None = None  # the name of the client's key; None: no keys configured
    waited: float = 0.0  # seconds spent in the queue so far, all waits together
    queued_since: float | None = None  # when the current wait began, while waiting

    def queued_for(self, now: float) -> float:
        """Seconds in the queue by ``now``, the current wait included."""
        current = now - self.queued_since if self.queued_since is not None else 0.0
        return self.waited + current

    def summary(self, now: float) -> dict[str, Any]:
        """The JSON form used by events, ``/status`` and the dashboard."""
        return {
            "id": self.id,
            "method": self.method,
            "path": self.path,
            "client": self.client,
            "state": str(self.state),
            "status": self.status,
            "node": self.node,
            "attempts": [record.to_json() for record in self.attempts],
            "ttfb_ms": (
                _ms(self.committed_at - self.started) if self.committed_at is not None else None
            ),
            "duration_ms": _ms(now - self.started),
            "queued_ms": _ms(self.queued_for(now)),
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


class Report:
    """The proxy's books and the telemetry written from them."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.cooldowns = CooldownTable()
        self.health = HealthBooks(node.name for node in config.upstreams)
        self.events = EventBus()
        self.metrics = Metrics(node.name for node in config.upstreams)
        self.stats = {node.name: NodeStats() for node in config.upstreams}
        # Slots from connect to the end of the relay: in_flight of SPEC 2.
        self.queue = SlotQueue(config, self.is_demoted)
        ledger = self.queue.scheduler.ledger
        for name in self.stats:
            # Read at scrape time: no gauge update per attempt.
            self.metrics.in_flight.labels(name).set_function(partial(ledger.in_flight, name))
        self.metrics.queue_length.set_function(self.queue.__len__)
        # Finished workloads and when they ended; summarised only when asked.
        self._recent: deque[tuple[Workload, float]] = deque(maxlen=RECENT_WORKLOADS)
        # Workloads not finished yet, oldest first (keyed by identity).
        self._live: dict[int, Workload] = {}

    # -- attempts ------------------------------------------------------------

    def attempt_failed(self, work: Workload, record: AttemptRecord, *, moving_on: bool) -> None:
        """Record a failed attempt before commit."""
        work.attempts.append(record)
        self.stats[record.node].failed += 1
        self.health.attempt_ended(record.node, str(record.outcome), record.detail)
        self.metrics.child(self.metrics.attempts, record.node, str(record.outcome)).inc()
        if moving_on:
            self.metrics.child(self.metrics.failovers, record.node, str(record.outcome)).inc()
        logger.warning(
            "failover" if moving_on else "attempt failed",
            extra={"fields": {"id": work.id, **record.to_json()}},
        )

    def committed(self, work: Workload, node: str, time_to_head: float, now: float) -> None:
        """Count a commit; an answer below 500 ends the node's cooldown (``ends_cooldown``)."""
        self.stats[node].served += 1
        alive = work.status is not None and ends_cooldown(work.status)
        ended = self.cooldowns.restore(node) if alive else None
        # The same test for down: a served answer proves the node is back.
        was_down = alive and self.health.served(node) is Health.READY
        if ended is not None:
            self.metrics.cooling.set(len(self.cooldowns.active(now)))
        if was_down:
            self.metrics.down.set(self.health.down_count())
        if was_down or (ended is not None and ended.until > now):
            self.node_ready(node, "success")
            self.queue.dispatch()
        self.metrics.child(self.metrics.commits, node).inc()
        self.metrics.child(self.metrics.time_to_head, node).observe(time_to_head)
        self.metrics.child(self.metrics.time_to_commit, node).observe(now - work.started)
        self.publish_workload(work)

    def stream_ended(self, work: Workload, record: AttemptRecord) -> None:
        """Record how a committed stream ended."""
        work.attempts.append(record)
        failed = record.outcome is not Outcome.COMPLETED
        self.health.attempt_ended(
            record.node, str(record.outcome), record.detail if failed else None
        )
        self.metrics.child(self.metrics.attempts, record.node, str(record.outcome)).inc()
        if not failed:
            return
        self.stats[record.node].failed += 1
        logger.warning("stream aborted", extra={"fields": {"id": work.id, **record.to_json()}})

    def client_aborted(self, work: Workload, record: AttemptRecord | None) -> None:
        """Record that the client left before the workload was settled."""
        if record is not None:
            work.attempts.append(record)
            self.metrics.child(self.metrics.attempts, record.node, str(record.outcome)).inc()
        self.metrics.client_aborts.inc()

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

    # -- workloads -----------------------------------------------------------

    def started(self, work: Workload) -> None:
        """A workload begins: ``/status`` lists it until ``finish``."""
        self._live[id(work)] = work

    def waited(self, work: Workload, started: float, now: float) -> None:
        """One wait in the queue ended (with a slot or not)."""
        work.waited += now - started
        work.queued_since = None
        self.metrics.queue_wait.observe(now - started)

    def turned_away(self, reason: str) -> None:
        """The queue refused a workload: ``queue_full``, ``queue_timeout`` or ``shutdown``."""
        self.metrics.child(self.metrics.queue_rejected, reason).inc()

    def publish_workload(self, work: Workload, *, position: int | None = None) -> None:
        """A ``workload`` event of the workload's current state (if anyone listens).

        ``position``: its place in the queue as it starts waiting (1 = next).
        """
        if not self.events.subscriber_count:
            return  # no dashboard open: nothing to build
        event: dict[str, Any] = {
            "type": "workload",
            "id": work.id,
            "state": str(work.state),
            "node": work.node,
            "attempt": work.attempt,
            "method": work.method,
            "path": work.path,
            "client": work.client,
        }
        if work.status is not None:
            event["status"] = work.status
        if position is not None:
            event["position"] = position
        self.events.publish(event)

    def finish(self, work: Workload) -> None:
        """Keep, count, publish and log a finished workload."""
        now = trio.current_time()
        self._live.pop(id(work), None)
        self._recent.append((work, now))
        client = ANONYMOUS if work.client is None else work.client
        self.metrics.child(self.metrics.workloads, str(work.state), client).inc()
        if work.node is not None:
            self.metrics.child(self.metrics.duration, work.node).observe(now - work.started)
        if self.events.subscriber_count:
            self.events.publish({"type": "workload", **work.summary(now), "attempt": work.attempt})
        if not access_logger.isEnabledFor(logging.INFO):
            return
        log_access(
            {
                "id": work.id,
                "method": work.method,
                "path": work.path,
                "client": work.client,
                "status": work.status,
                "state": str(work.state),
                "nodes": [f"{r.node}:{r.outcome}" for r in work.attempts],
                "commit_ms": (
                    _ms(work.committed_at - work.started) if work.committed_at is not None else None
                ),
                "duration_ms": _ms(now - work.started),
                "queued_ms": _ms(work.waited),
                "bytes": work.body_bytes,
            }
        )

    def unauthorized(
        self, request_id: str, method: str, path: str, started: float, sent: int = 0
    ) -> None:
        """Count and log a request refused for want of a valid key (no workload).

        It stays out of ``/status`` and the events: a client without a key
        must not be able to push the fleet's workloads out of view.
        """
        self.metrics.child(self.metrics.unauthorized, "client").inc()
        log_access(
            {
                "id": request_id,
                "method": method,
                "path": path,
                "client": None,
                "status": 401,
                "state": "unauthorized",
                "nodes": [],
                "commit_ms": None,
                "duration_ms": _ms(trio.current_time() - started),
                "bytes": sent,  # the 401's own body
            }
        )

    @property
    def recent(self) -> list[dict[str, Any]]:
        """The last finished workloads, oldest first, in their ``/status`` form."""
        return [work.summary(ended) for work, ended in self._recent]

    def status(self) -> dict[str, Any]:
        """The ``GET /status`` document (SPEC 6)."""
        now = trio.current_time()
        self.expire_cooldowns(now)
        nodes = []
        for node in self.config.upstreams:
            entry = self.cooldowns.get(node.name, now)
            stats = self.stats[node.name]
            ledger = self.queue.scheduler.ledger
            health = self.health.nodes[node.name]
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
                    "capacity": node.capacity,
                    "served": stats.served,
                    "failed": stats.failed,
                    "models": list(models) if models is not None else None,
                    "last_outcome": health.last_outcome,
                    "last_error": health.last_error,
                }
            )
        live = [work.summary(now) for work in self._live.values()]
        return {
            "version": __version__,
            "queued": len(self.queue),
            "nodes": nodes,
            "workloads": self.recent + live,
        }
