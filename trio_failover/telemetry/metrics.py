"""Prometheus metrics, one registry per proxy (tests and embedders may run several).

The text exposition is prometheus-client's own ``generate_latest``: no
formatter of ours to get wrong. Counter names gain the ``_total`` suffix in
the exposition (``trio_failover_attempts_total``). docs/observability.md
lists every series with example queries.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from typing import Any, TypeVar

from prometheus_client import (
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.exposition import choose_encoder

from ..core.version import __version__
from .held import FlushingRegistry, HeldCounter, HeldHistograms

# Seconds; spans fast local nodes to long cold prefills.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# Why the queue turned a workload away: the ``reason`` label of queue_rejected.
QUEUE_REJECTIONS = ("queue_full", "queue_timeout", "shutdown")

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)

# Where a time to first byte goes while no history sampler runs: nowhere.
_NOWHERE: deque[float] = deque(maxlen=0)


class Metrics:
    """The proxy's counters, gauges and histograms."""

    def __init__(self, nodes: Iterable[str] = ()) -> None:
        self.registry = FlushingRegistry()
        r = self.registry
        self.build = Info("trio_failover_build", "Version of the proxy", registry=r)
        self.build.info({"version": __version__})
        self._define_traffic(r)
        self._define_queue(r)
        self._define_latencies(r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # The series every request updates, held between scrapes (held.py).
        self._attempts = HeldCounter(self.attempts)
        self._commits = HeldCounter(self.commits)
        self._workloads = HeldCounter(self.workloads)
        self._time_to_head = HeldHistograms(self.time_to_head, _LATENCY_BUCKETS)
        self._time_to_commit = HeldHistograms(self.time_to_commit, _LATENCY_BUCKETS)
        self._duration = HeldHistograms(self.duration, _LATENCY_BUCKETS)
        self.registry.held += [
            self._attempts,
            self._commits,
            self._workloads,
            self._time_to_head,
            self._time_to_commit,
            self._duration,
        ]
        self.declare_nodes(nodes)
        # Each commit's time to first byte, by node, for the dashboard's
        # history: the admin listener's sampler (service/sampler.py) puts
        # its lists here while it runs; until then the append goes nowhere.
        self.ttfb_samples: dict[str, list[float]] = {}

    def _define_traffic(self, r: FlushingRegistry) -> None:
        """The series of attempts, nodes, commits and workloads."""
        self.attempts = Counter(
            "trio_failover_attempts",
            "Attempts by node and outcome",
            ["node", "outcome"],
            registry=r,
        )
        self.failovers = Counter(
            "trio_failover_failovers",
            "Moves from one node to the next",
            ["node", "outcome"],
            registry=r,
        )
        self.cooldowns = Counter(
            "trio_failover_cooldowns", "Cooldowns started", ["node", "reason"], registry=r
        )
        self.cooling = Gauge("trio_failover_cooling_nodes", "Nodes cooling now", registry=r)
        self.model_cooldowns = Counter(
            "trio_failover_model_cooldowns", "Cooldowns of one model of a node (SPEC 5c)",
            ["node", "model", "reason"], registry=r,
        )  # fmt: skip
        self.checks = Counter(
            "trio_failover_health_checks",
            "Health and inventory checks (GET /health, /v1/models) by node and result",
            ["node", "result"],
            registry=r,
        )
        self.liveness_checks = Counter(
            "trio_failover_liveness_checks",
            "Liveness checks (GET /health of a node an attempt waits on) by node and result",
            ["node", "result"],
            registry=r,
        )
        self.down = Gauge(
            "trio_failover_down_nodes", "Nodes down now (last check failed)", registry=r
        )
        self.client_aborts = Counter(
            "trio_failover_client_aborts", "Workloads cancelled by the client leaving", registry=r
        )
        self.commits = Counter(
            "trio_failover_commits", "Responses committed to clients", ["node"], registry=r
        )
        self.workloads = Counter(
            "trio_failover_workloads",
            "Finished workloads by final state and client",
            ["state", "client"],
            registry=r,
        )
        self.unauthorized = Counter(
            "trio_failover_unauthorized",
            "Requests refused with 401 for want of a valid key or admin token",
            ["listener"],
            registry=r,
        )
        self.stray_bytes = Counter(
            "trio_failover_stray_bytes",
            "Pooled node connections closed for bytes sent after a complete answer",
            ["node"],
            registry=r,
        )
        self.stale_resends = Counter(
            "trio_failover_stale_resends",
            "Requests sent again on a fresh connection: the node closed a pooled one at once",
            ["node"],
            registry=r,
        )
        self.in_flight = Gauge(
            "trio_failover_in_flight", "Attempts and streams in flight", ["node"], registry=r
        )
        self.capacity, self.engine_busy, self.engine_waiting = _engine_gauges(r)

    def _define_queue(self, r: FlushingRegistry) -> None:
        """The series of the slot queue."""
        self.queue_length = Gauge(
            "trio_failover_queue_length", "Workloads waiting for a slot now", registry=r
        )
        self.queue_wait = _latency(
            "trio_failover_queue_wait_seconds",
            "Time one wait for a slot lasted (one workload may wait more than once)",
            r,
        )
        self.queue_rejected = Counter(
            "trio_failover_queue_rejected",
            "Workloads turned away by the queue, by reason",
            ["reason"],
            registry=r,
        )
        for reason in QUEUE_REJECTIONS:  # a closed set: export it at zero
            self.queue_rejected.labels(reason)

    def _define_latencies(self, r: FlushingRegistry) -> None:
        """The latency histograms, by node."""
        by_node = ("node",)
        self.time_to_head = _latency(
            "trio_failover_time_to_head_seconds",
            "Request written to response head read",
            r,
            by_node,
        )
        self.time_to_commit = _latency(
            "trio_failover_time_to_commit_seconds", "Workload start to commit", r, by_node
        )
        self.duration = _latency(
            "trio_failover_workload_duration_seconds", "Workload start to end", r, by_node
        )

    # -- the per-request updates, held (the lookups inlined: one call each) --

    def attempt_ended(self, node: str, outcome: str) -> None:
        """Count one attempt of ``node`` that ended with ``outcome`` (``attempts``)."""
        attempts = self._attempts
        (attempts.by_labels.get((node, outcome)) or attempts.of(node, outcome)).count += 1

    def committed(self, node: str, time_to_head: float, time_to_commit: float) -> None:
        """Count a commit at ``node`` and observe its two latencies."""
        commits = self._commits
        (commits.by_labels.get((node,)) or commits.of(node)).count += 1
        head = self._time_to_head.by_node.get(node) or self._time_to_head.of(node)
        head.buckets[bisect_left(head.bounds, time_to_head)] += 1
        head.total += time_to_head
        commit = self._time_to_commit.by_node.get(node) or self._time_to_commit.of(node)
        commit.buckets[bisect_left(commit.bounds, time_to_commit)] += 1
        commit.total += time_to_commit
        self.ttfb_samples.get(node, _NOWHERE).append(time_to_commit)

    def finished(self, state: str, client: str, node: str | None, duration: float) -> None:
        """Count a finished workload; observe its duration when a node took it."""
        workloads = self._workloads
        (workloads.by_labels.get((state, client)) or workloads.of(state, client)).count += 1
        if node is not None:
            held = self._duration.by_node.get(node) or self._duration.of(node)
            held.buckets[bisect_left(held.bounds, duration)] += 1
            held.total += duration

    def child(self, metric: _Metric, *labels: str) -> _Metric:
        """``metric.labels(*labels)``, kept: the proxy asks on every request.

        Label values come from closed sets (node names, outcomes, states), so
        the cache stays small.
        """
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def declare_nodes(self, nodes: Iterable[str]) -> None:
        """Export the per-node series at zero before any traffic.

        Without this a node's series appear only with its first event, and
        ``rate()`` or ``increase()`` over a window that spans that moment
        under-counts it. Series labelled by outcome or reason still appear
        on first use: their label sets are open-ended.
        """
        for node in nodes:
            self.commits.labels(node)
            self.stray_bytes.labels(node)
            self.stale_resends.labels(node)
            self.in_flight.labels(node)
            self.time_to_head.labels(node)
            self.time_to_commit.labels(node)
            self.duration.labels(node)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """All metrics in the format the scraper's ``Accept`` header asks for.

        Returns:
            The body and its content type: OpenMetrics when asked for
            (Prometheus does by default), else the classic text format.
        """
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def _latency(
    name: str, documentation: str, registry: FlushingRegistry, labels: tuple[str, ...] = ()
) -> Histogram:
    """A histogram of seconds with the latency buckets."""
    return Histogram(name, documentation, labels, buckets=_LATENCY_BUCKETS, registry=registry)


def _engine_gauges(r: FlushingRegistry) -> tuple[Gauge, Gauge, Gauge]:
    """What the slot decisions use of each node now (SPEC 5c), read at scrape time."""
    return (
        Gauge(
            "trio_failover_capacity",
            "Attempts a node takes at once now (0 = no limit; auto: the engine's)",
            ["node"],
            registry=r,
        ),
        Gauge(
            "trio_failover_engine_busy",
            "Requests the node's engine says it works on (NaN: no fresh reading)",
            ["node"],
            registry=r,
        ),
        Gauge(
            "trio_failover_engine_waiting",
            "Requests queued inside the node's engine (NaN: no fresh reading)",
            ["node"],
            registry=r,
        ),
    )
