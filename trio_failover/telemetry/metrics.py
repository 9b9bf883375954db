"""Prometheus metrics, one registry per proxy (tests and embedders may run several).

The text exposition is prometheus-client's own ``generate_latest``: no
formatter of ours to get wrong. Counter names gain the ``_total`` suffix in
the exposition (``trio_failover_attempts_total``). docs/observability.md
lists every series with example queries.

``--workers N``: each worker is a process with its own proxy, and the one
``/metrics`` (the first worker's admin listener) must add up all of them.
That is prometheus-client's multiprocess mode: the supervisor gives every
worker ``PROMETHEUS_MULTIPROC_DIR``, a private directory of its own, where
prometheus-client keeps each process's values in memory-mapped files, and
the worker's ``main`` calls ``share_in`` before its proxy exists. Then:

- ``render`` reads the directory (``MultiProcessCollector``): counters and
  histograms are summed over every worker, a dead one's too (its counts
  happened); each gauge is combined by the mode its meaning asks for (the
  ``multiprocess_mode`` given where it is defined: ``livesum`` for this
  process's own work, ``livemostrecent`` for news every worker hears,
  ``livemax``/``livemin`` for a reading where the extreme is the one to
  see), over the live workers only (the supervisor drops a dead worker's
  gauges with ``mark_process_dead``);
- the files only hold what was written to them: the held counts
  (``held.py``) and the gauges read at scrape time (``set_function``,
  which prometheus-client cannot share) are written by ``share``, every
  ``SHARE_INTERVAL`` by ``share_every`` (a task of the proxy's own), once
  more when it stops, and by the first worker just before each scrape;
- ``trio_failover_build_info`` (an ``Info``: no file holds one) is this
  process's: every worker runs the same program.

A single proxy (``--workers 1``, an embedder, a test) shares nothing and
renders its own registry, as it always has.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from ..core.version import __version__
from .held import FlushingRegistry, HeldCounter, HeldHistograms

# Seconds; spans fast local nodes to long cold prefills.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# Why the queue turned a workload away: the ``reason`` label of queue_rejected.
QUEUE_REJECTIONS = ("queue_full", "queue_timeout", "shutdown")

# A node's state, as /status names it: the ``state`` label of node_state.
NODE_STATES = ("ready", "cooling", "down")

# How a reload ended: the ``result`` label of reloads.
RELOAD_RESULTS = ("ok", "failed")

# Seconds between two writes of a worker's counts and readings to the shared
# files: what another worker's /metrics may lag by. Scrapes come every 15 s
# or more; a write is a few microseconds per series that changed.
SHARE_INTERVAL = 1.0

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)

# Where a time to first byte goes while no history sampler runs: nowhere.
_NOWHERE: deque[float] = deque(maxlen=0)

# The directory this process shares its metrics through (``share_in``), if any.
_shared_in: list[str] = []


def share_in(directory: str) -> None:
    """Make the ``Metrics`` made from now on in this process share through ``directory``.

    A ``--workers`` worker calls it once, before its proxy exists, with the
    ``PROMETHEUS_MULTIPROC_DIR`` its supervisor gave it (and that
    prometheus-client read at import).
    """
    _shared_in[:] = [directory]


class ReadGauge(Gauge):
    """A gauge that may be read at scrape time (``set_function``) and also written down.

    prometheus-client's multiprocess mode reads files, never a function:
    ``write_down`` sets each child that has one to what it reads now, so
    the reading reaches the files (``Metrics.share``).
    """

    _reader: Callable[[], float] | None = None

    def set_function(self, f: Callable[[], float]) -> None:
        super().set_function(f)
        self._reader = f

    def write_down(self) -> None:
        """Set every child read by a function (itself, unlabelled) to its reading now."""
        children: list[Any] = [self]
        if self._labelnames:
            with self._lock:  # labels() adds children under it
                children = list(self._metrics.values())
        for child in children:
            if child._reader is not None:
                child.set(child._reader())


class Metrics:
    """The proxy's counters, gauges and histograms."""

    def __init__(self, nodes: Iterable[str] = ()) -> None:
        self.registry = FlushingRegistry()
        # The --workers directory, or None: this process alone (module docstring).
        self.shared_in: str | None = _shared_in[0] if _shared_in else None
        r = self.registry
        self.build = Info("trio_failover_build", "Version of the proxy", registry=r)
        self.build.info({"version": __version__})
        self._define_traffic(r)
        self._define_queue(r)
        self._define_latencies(r)
        self._define_alerts(r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # The series every request updates, held between scrapes (held.py).
        self._attempts = HeldCounter(self.attempts)
        self._commits = HeldCounter(self.commits)
        self._workloads = HeldCounter(self.workloads)
        self._tokens = HeldCounter(self.tokens)
        self._affinity_requests = HeldCounter(self.affinity_requests)
        self._affinity_matched_bytes = HeldCounter(self.affinity_matched_bytes)
        self._time_to_head = HeldHistograms(self.time_to_head, _LATENCY_BUCKETS)
        self._time_to_commit = HeldHistograms(self.time_to_commit, _LATENCY_BUCKETS)
        self._duration = HeldHistograms(self.duration, _LATENCY_BUCKETS)
        self.registry.held += [
            self._attempts,
            self._commits,
            self._workloads,
            self._tokens,
            self._affinity_requests,
            self._affinity_matched_bytes,
            self._time_to_head,
            self._time_to_commit,
            self._duration,
        ]
        self.declare_nodes(nodes)
        # Said once now: a worker's gauge of the newest word (livemostrecent)
        # is in no /metrics before its first word.
        self.cooling.set(0)
        self.down.set(0)
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
        # The board's news, which every worker hears: the newest word counts.
        self.cooling = Gauge(
            "trio_failover_cooling_nodes",
            "Nodes cooling now",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.model_cooldowns = Counter(
            "trio_failover_model_cooldowns",
            "Cooldowns of one model of a node serving several (the others keep serving)",
            ["node", "model", "reason"],
            registry=r,
        )
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
            "trio_failover_down_nodes",
            "Nodes down now (last check failed)",
            registry=r,
            multiprocess_mode="livemostrecent",
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
        # Summed over --workers like every counter. ``model``: the name the
        # client asked for, as GET /usage shows it (core/usage_book.py bounds them).
        self.tokens = Counter(
            "trio_failover_tokens",
            "Tokens of the answers, as the engines told them or estimated, by kind",
            ["client", "model", "node", "kind"],
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
            "Requests sent on a fresh connection: a pooled one the node closed refused the write",
            ["node"],
            registry=r,
        )
        self.affinity_requests = Counter(
            "trio_failover_affinity_requests",
            "Requests served with cache affinity on, by whether their prompt matched "
            "a chain the serving node had served (hit) or not (miss)",
            ["node", "result"],
            registry=r,
        )
        self.affinity_matched_bytes = Counter(
            "trio_failover_affinity_matched_bytes",
            "Prompt bytes of the served requests that matched a chain the serving node had served",
            ["node"],
            registry=r,
        )
        self.in_flight = ReadGauge(
            "trio_failover_in_flight",
            "Attempts and streams in flight",
            ["node"],
            registry=r,
            multiprocess_mode="livesum",  # each worker's own
        )
        self.capacity, self.engine_busy, self.engine_waiting = _engine_gauges(r)

    def _define_queue(self, r: FlushingRegistry) -> None:
        """The series of the slot queue."""
        self.queue_length = ReadGauge(
            "trio_failover_queue_length",
            "Workloads waiting for a slot now",
            registry=r,
            multiprocess_mode="livesum",  # each worker has its own queue
        )
        self.queue_wait = _latency(
            "trio_failover_queue_wait_seconds",
            "Time one wait for a slot lasted (one workload may wait more than once)",
            r,
        )
        self.queue_rejected = _closed_counter(
            "trio_failover_queue_rejected",
            "Workloads turned away by the queue, by reason",
            ("reason", QUEUE_REJECTIONS),
            r,
        )

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

    def _define_alerts(self, r: FlushingRegistry) -> None:
        """What an operator alerts on: each node's state, the shared state's link, reloads."""
        self.node_state = Gauge(
            "trio_failover_node_state",
            "Each node's state now: 1 for the state it is in, 0 for the others",
            ["node", "state"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        # Each worker has its own link to Redis: one cut off is the news.
        self.state_connected = ReadGauge(
            "trio_failover_state_connected",
            "Whether the shared state (Redis) answers now: 1, or 0 while going on alone",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.state_replicas = ReadGauge(
            "trio_failover_state_replicas",
            "Live replicas sharing the state, this one included, as last seen",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.reloads = _closed_counter(
            "trio_failover_reloads",
            "Configuration reloads by result (failed: refused, nothing changed)",
            ("result", RELOAD_RESULTS),
            r,
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

    def used(self, client: str, model: str, node: str, prompt: int, completion: int) -> None:
        """Count an answer's ``prompt`` and ``completion`` tokens (``tokens``)."""
        tokens = self._tokens
        labels = (client, model, node, "prompt")
        (tokens.by_labels.get(labels) or tokens.of(*labels)).count += prompt
        labels = (client, model, node, "completion")
        (tokens.by_labels.get(labels) or tokens.of(*labels)).count += completion

    def affinity_served(self, node: str, hit: bool, matched_bytes: int) -> None:
        """Count a request ``node`` served with cache affinity on: a hit or a miss, its bytes."""
        requests = self._affinity_requests
        labels = (node, "hit" if hit else "miss")
        (requests.by_labels.get(labels) or requests.of(*labels)).count += 1
        if matched_bytes:
            matched = self._affinity_matched_bytes
            (matched.by_labels.get((node,)) or matched.of(node)).count += matched_bytes

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
            self.affinity_requests.labels(node, "hit")
            self.affinity_requests.labels(node, "miss")
            self.affinity_matched_bytes.labels(node)
            self.in_flight.labels(node)
            self.time_to_head.labels(node)
            self.time_to_commit.labels(node)
            self.duration.labels(node)
            self.node_is(node, "ready")  # a node starts ready; the board's news follows

    def node_is(self, node: str, state: str | None) -> None:
        """Set ``node``'s ``node_state``: 1 for ``state``, 0 for the others (None: all 0)."""
        for each in NODE_STATES:
            self.child(self.node_state, node, each).set(each == state)

    def reloaded(self, ok: bool) -> None:
        """Count one reload (``reloads``): applied, or refused."""
        self.child(self.reloads, "ok" if ok else "failed").inc()

    def read_state(self, status: Callable[[], Mapping[str, Any]]) -> None:
        """Have the shared-state gauges read ``status`` (``/status``'s ``state``)."""
        self.state_connected.set_function(lambda: float(status()["connected"]))
        self.state_replicas.set_function(lambda: float(status()["replicas"]))

    # -- the --workers sharing (module docstring) ----------------------------------

    def share(self) -> None:
        """Write this process's held counts and scrape-time readings to the shared files."""
        self.registry.flush()
        for gauge in self._read_gauges:
            gauge.write_down()

    async def share_every(self, interval: float = SHARE_INTERVAL) -> None:
        """In a worker: ``share`` every ``interval`` seconds, and once more when cancelled.

        Returns at once in a proxy that shares nothing. Runs as one of the
        proxy's own tasks, which stop after its last connection ended: the
        last write has every count.
        """
        if self.shared_in is None:
            return
        try:
            while True:
                self.share()
                await trio.sleep(interval)
        finally:
            self.share()

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """All metrics in the format the scraper's ``Accept`` header asks for.

        Returns:
            The body and its content type: OpenMetrics when asked for
            (Prometheus does by default), else the classic text format.
        """
        encoder, content_type = choose_encoder(accept)
        if self.shared_in is None:
            return encoder(self.registry), content_type
        self.share()  # this worker's own, current to the scrape
        every_worker = CollectorRegistry()  # no describe: that would read the files twice
        MultiProcessCollector(every_worker, path=self.shared_in)  # type: ignore[no-untyped-call]
        every_worker.register(self.build)
        return encoder(every_worker), content_type

    @property
    def _read_gauges(self) -> tuple[ReadGauge, ...]:
        return (
            self.in_flight,
            self.capacity,
            self.engine_busy,
            self.engine_waiting,
            self.queue_length,
            self.state_connected,
            self.state_replicas,
        )


def _closed_counter(
    name: str, documentation: str, label: tuple[str, tuple[str, ...]], registry: FlushingRegistry
) -> Counter:
    """A counter of one label whose values are a closed set, each exported at zero."""
    counter = Counter(name, documentation, [label[0]], registry=registry)
    for value in label[1]:
        counter.labels(value)
    return counter


def _latency(
    name: str, documentation: str, registry: FlushingRegistry, labels: tuple[str, ...] = ()
) -> Histogram:
    """A histogram of seconds with the latency buckets."""
    return Histogram(name, documentation, labels, buckets=_LATENCY_BUCKETS, registry=registry)


def _engine_gauges(r: FlushingRegistry) -> tuple[ReadGauge, ReadGauge, ReadGauge]:
    """What the slot decisions use of each node now (from the engines' own counts where
    they tell them), read at scrape time: the same node for every worker."""
    return (
        ReadGauge(
            "trio_failover_capacity",
            "Attempts a node takes at once now (0 = no limit; auto: the engine's)",
            ["node"],
            registry=r,
            multiprocess_mode="livemax",
        ),
        ReadGauge(
            "trio_failover_engine_busy",
            "Requests the node's engine says it works on (NaN: no fresh reading)",
            ["node"],
            registry=r,
            multiprocess_mode="livemostrecent",
        ),
        ReadGauge(
            "trio_failover_engine_waiting",
            "Requests queued inside the node's engine (NaN: no fresh reading)",
            ["node"],
            registry=r,
            multiprocess_mode="livemostrecent",
        ),
    )
