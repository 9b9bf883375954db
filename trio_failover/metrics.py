"""Prometheus metrics, one registry per proxy (tests and embedders may run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; spans fast local nodes to long cold prefills.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The proxy's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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
        self.client_aborts = Counter(
            "trio_failover_client_aborts", "Workloads cancelled by the client leaving", registry=r
        )
        self.commits = Counter(
            "trio_failover_commits", "Responses committed to clients", ["node"], registry=r
        )
        self.workloads = Counter(
            "trio_failover_workloads", "Finished workloads by final state", ["state"], registry=r
        )
        self.in_flight = Gauge(
            "trio_failover_in_flight", "Attempts and streams in flight", ["node"], registry=r
        )
        self.time_to_head = Histogram(
            "trio_failover_time_to_head_seconds",
            "Request written to response head read",
            ["node"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_commit = Histogram(
            "trio_failover_time_to_commit_seconds",
            "Workload start to commit",
            ["node"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "trio_failover_workload_duration_seconds",
            "Workload start to end",
            ["node"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def exposition(self) -> bytes:
        """The text exposition format of all metrics."""
        return generate_latest(self.registry)
