"""Counts held as plain Python numbers between scrapes, for the per-request series.

A prometheus-client update is a lookup of the labelled child, a check that
the child may be observed, and a lock around the add: about 8,000
instructions for a counter and 12,000 for a histogram, six times a request.
The series every request updates hold their counts here instead, as ints
and floats on a small object per label set, and ``FlushingRegistry`` adds
what each gained since the last scrape to its prometheus-client child just
before any collection through the registry (``/metrics``,
``get_sample_value``, a restricted view): the exposition is
prometheus-client's own, series, ``_created`` and all. Only a reader that
asks one metric object for its samples directly, past the registry, sees
the counts as of the last collection. In a ``--workers`` worker the
children's values are prometheus-client's shared files, which the first
worker's ``/metrics`` reads: ``Metrics.share`` flushes for them every
second and once more as the worker stops (``metrics.py``).

The child of a label set is made when the set is first counted, as
``labels()`` would have made it then, so its ``_created`` is the time of
its first event as before. The rare updates (failovers, cooldowns, checks)
still go to their children directly; a child may get both, since a scrape
adds only what the hold gained.

Only Trio's thread counts. A scrape from another thread (an embedder's own
exporter) only reads the held numbers and keeps what it has added in
``flushed``, so it can neither lose nor double an update; one lock keeps
two scrapes from adding the same gain twice.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import RestrictedRegistry


class HeldCount:
    """One label set of a counter: its child, its count, and what a scrape added of it."""

    __slots__ = ("child", "count", "flushed")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.count = 0
        self.flushed = 0

    def flush(self) -> None:
        count = self.count
        if count != self.flushed:
            self.child.inc(count - self.flushed)
            self.flushed = count


class HeldHistogram:
    """One label set of a histogram: observations per bucket and their sum, held.

    ``observe`` is the hot path: ``buckets[bisect_left(bounds, value)] += 1``
    finds the first bucket whose upper bound is at least the value, as
    prometheus-client's own ``observe`` does (the values here, durations
    from Trio's clock, are never NaN).
    """

    __slots__ = ("bounds", "buckets", "child", "flushed_buckets", "flushed_total", "total")

    def __init__(self, child: Any, bounds: Sequence[float]) -> None:
        self.child = child
        self.bounds = (*bounds, math.inf)
        # Adding held buckets needs the child's own bounds to be these.
        if list(child._upper_bounds) != list(self.bounds):
            raise ValueError(f"histogram buckets {child._upper_bounds} are not {self.bounds}")
        self.buckets = [0] * len(self.bounds)
        self.flushed_buckets = [0] * len(self.bounds)
        self.total = 0.0
        self.flushed_total = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (the hot paths inline this)."""
        self.buckets[bisect_left(self.bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        # prometheus-client keeps a histogram child's buckets apart (it adds
        # them up when collected) and its sum as values with a public inc():
        # the held gains go there, one add per bucket that gained.
        buckets = self.buckets[:]
        for index, count in enumerate(buckets):
            gained = count - self.flushed_buckets[index]
            if gained:
                self.child._buckets[index].inc(gained)
        self.flushed_buckets = buckets
        total = self.total
        if total != self.flushed_total:
            self.child._sum.inc(total - self.flushed_total)
            self.flushed_total = total


class HeldCounter:
    """A labelled counter whose per-request updates are held (``HeldCount`` per label set)."""

    __slots__ = ("by_labels", "metric")

    def __init__(self, metric: Counter) -> None:
        self.metric = metric
        self.by_labels: dict[tuple[str, ...], HeldCount] = {}

    def of(self, *labels: str) -> HeldCount:
        """The held count of ``labels``, made (with its child) on first use."""
        found = self.by_labels.get(labels)
        if found is None:
            found = self.by_labels[labels] = HeldCount(self.metric.labels(*labels))
        return found

    def flush(self) -> None:
        for held in list(self.by_labels.values()):  # a copy: another thread may add one
            held.flush()


class HeldHistograms:
    """A histogram labelled by node whose observations are held (``HeldHistogram`` per node)."""

    __slots__ = ("bounds", "by_node", "metric")

    def __init__(self, metric: Histogram, bounds: Sequence[float]) -> None:
        self.metric = metric
        self.bounds = bounds
        self.by_node: dict[str, HeldHistogram] = {}

    def of(self, node: str) -> HeldHistogram:
        """The held observations of ``node``, made (with its child) on first use."""
        found = self.by_node.get(node)
        if found is None:
            found = self.by_node[node] = HeldHistogram(self.metric.labels(node), self.bounds)
        return found

    def flush(self) -> None:
        for held in list(self.by_node.values()):
            held.flush()


class FlushingRegistry(CollectorRegistry):
    """A registry that first adds the held counts to their children, then collects."""

    def __init__(self, held: Iterable[HeldCounter | HeldHistograms] = ()) -> None:
        super().__init__(auto_describe=True)
        self.held: list[HeldCounter | HeldHistograms] = list(held)
        self._flush_lock = threading.Lock()

    def flush(self) -> None:
        """Add what every held series gained since the last flush to its child."""
        with self._flush_lock:
            for held in self.held:
                held.flush()

    def collect(self) -> Iterable[Metric]:
        self.flush()
        return super().collect()

    def restricted_registry(self, names: Iterable[str]) -> RestrictedRegistry:
        # The restricted view collects the collectors directly, not through
        # collect(): flush for it here, just before it is read.
        self.flush()
        return super().restricted_registry(names)
