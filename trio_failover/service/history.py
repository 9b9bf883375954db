"""The dashboard's last 15 minutes: a fixed-size ring of points per node.

Pure: no Trio, no clock. The sampler (``sampler.py``) looks at the proxy
``LOOKS`` times per interval and hands each look to ``History.observe``
with the Trio time ``now``; at the first look of a new interval the one
before it is closed into one ``Point`` per node, and ``GET /history``
(``History.document``) shows the last ``POINTS`` of them, oldest first.

What a point holds, and where it comes from:

- ``slots``, ``queue``: the most slots in use at the node, and the most
  workloads waiting that the node could take, at any look of the interval.
  Read off the slot ledger and the queue; nothing on the request path.
- ``ttfb_p50_ms``, ``ttfb_p95_ms``: the time to first byte (workload start
  to commit, the ``ttfb_ms`` of ``/status``) of the commits in the interval,
  nearest-rank percentiles; ``None`` when nothing committed. The one cost
  on the request path: ``Metrics.committed`` appends the time to the
  node's list in ``History.ttfb`` while a sampler runs.
- ``failures``: how much the node's ``failed`` count of ``/status`` (attempts
  failed before commit, streams broken after it) grew in the interval.

Intervals are numbered ``floor(now / interval)``, so two histories with the
same interval close at the same moments. An interval without any look (the
process was stopped, or the event loop blocked that long) has no point:
``None`` in every series, so the time axis stays true.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

INTERVAL = 10.0  # seconds per point
POINTS = 90  # points per series: 15 minutes at INTERVAL
LOOKS = 10  # looks at the proxy per interval
# Series of the document, in the order the dashboard draws them.
SERIES = ("slots", "queue", "ttfb_p50_ms", "ttfb_p95_ms", "failures")
# Absorbs the rounding of k * interval / interval to just below k.
_EPSILON = 1e-9

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Reading:
    """What one look sees of one node."""

    in_flight: int  # slots in use now
    queued: int  # workloads waiting now that this node could take
    failed: int  # the node's ``failed`` count so far (it only grows)


@dataclass(frozen=True, slots=True)
class Point:
    """One node's interval, as ``GET /history`` shows it."""

    slots: int
    queue: int
    ttfb_p50_ms: float | None
    ttfb_p95_ms: float | None
    failures: int


class Ring(Generic[T]):
    """The values of the last ``size`` intervals, by interval number.

    A fixed list written in place: a point costs one assignment (plus one
    per interval skipped since the newest), and memory never grows.
    """

    __slots__ = ("_values", "newest")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a ring holds at least one value, not {size}")
        self._values: list[T | None] = [None] * size
        self.newest: int | None = None  # the number of the newest interval put

    def put(self, index: int, value: T) -> None:
        """Set interval ``index``; the intervals skipped since the newest become None.

        An interval older than the newest is rewritten while the ring still
        holds it, else ignored: the newest never moves back.
        """
        size = len(self._values)
        newest = self.newest
        if newest is not None and index <= newest:
            if index > newest - size:
                self._values[index % size] = value
            return
        if newest is not None:
            for skipped in range(newest + 1, min(index, newest + 1 + size)):
                self._values[skipped % size] = None
        self._values[index % size] = value
        self.newest = index

    def values(self) -> list[T | None]:
        """The last ``size`` intervals up to the newest, oldest first; None: no value."""
        size = len(self._values)
        if self.newest is None:
            return [None] * size
        first = self.newest - size + 1
        return [self._values[index % size] for index in range(first, self.newest + 1)]


def percentile(ordered: list[float], fraction: float) -> float:
    """The nearest-rank percentile of sorted, non-empty ``ordered`` (``fraction`` in (0, 1]).

    Nearest rank gives a value that was observed, never one between two.
    """
    rank = math.ceil(fraction * len(ordered) - _EPSILON)
    return ordered[max(rank, 1) - 1]


@dataclass(slots=True)
class _Open:
    """The interval being filled for one node."""

    failed_before: int  # the node's failed count as the interval began
    slots: int = 0
    queue: int = 0


class History:
    """Every node's ring and the interval being filled."""

    def __init__(
        self,
        nodes: Iterable[str],
        *,
        interval: float = INTERVAL,
        points: int = POINTS,
        looks: int = LOOKS,
    ) -> None:
        """Empty rings for ``nodes``.

        Args:
            nodes: the node names, in the order the document lists them.
            interval: seconds per point.
            points: points per ring.
            looks: looks per interval the sampler makes (``next_look``).

        Raises:
            ValueError: a non-positive interval, points or looks.
        """
        if not interval > 0 or looks < 1:
            raise ValueError(f"interval and looks must be positive, not {interval}, {looks}")
        self.interval = interval
        self.looks = looks
        self.rings: dict[str, Ring[Point]] = {name: Ring(points) for name in nodes}
        self.points = points
        # Seconds to first byte of each commit since the open interval began,
        # by node: ``Metrics.committed`` appends here (the sampler installs it).
        self.ttfb: dict[str, list[float]] = {name: [] for name in self.rings}
        self.closed = 0  # intervals closed since the first look
        self._index: int | None = None  # the open interval's number
        self._open: dict[str, _Open] = {}

    def interval_of(self, now: float) -> int:
        """The number of the interval ``now`` falls in."""
        return math.floor(now / self.interval + _EPSILON)

    def next_look(self, now: float) -> float:
        """When the sampler looks next: the next multiple of ``interval / looks``.

        Every interval's first look is at its very start, so the samples of
        one interval's commits are not counted in the next one.
        """
        tick = self.interval / self.looks
        return (math.floor(now / tick + _EPSILON) + 1) * tick

    def observe(self, now: float, readings: Mapping[str, Reading]) -> None:
        """Take one look; the first look in a new interval closes the open one.

        Args:
            now: the Trio time of the look.
            readings: what the look saw, by node (nodes left out count as idle).
        """
        index = self.interval_of(now)
        if self._index is not None and index > self._index:
            self._close(self._index, readings)
        if self._index is None or index > self._index:
            self._index = index
            self._open = {
                name: _Open(failed_before=reading.failed) for name, reading in readings.items()
            }
        for name, reading in readings.items():
            current = self._open.get(name)
            if current is None:
                current = self._open[name] = _Open(failed_before=reading.failed)
            current.slots = max(current.slots, reading.in_flight)
            current.queue = max(current.queue, reading.queued)

    def follow(self, nodes: list[str]) -> None:
        """Rings for ``nodes`` in their order (a reload changed the list); kept ones keep theirs."""
        self.rings = {name: self.rings.get(name) or Ring(self.points) for name in nodes}
        for name in [name for name in self.ttfb if name not in self.rings]:
            del self.ttfb[name]  # in place: the metrics append to this very dict
        for name in nodes:
            self.ttfb.setdefault(name, [])

    def _close(self, index: int, readings: Mapping[str, Reading]) -> None:
        for name, ring in self.rings.items():
            current = self._open.get(name) or _Open(failed_before=0)
            samples = self.ttfb[name]
            self.ttfb[name] = []
            p50 = p95 = None
            if samples:
                samples.sort()
                p50 = round(percentile(samples, 0.5) * 1000, 1)
                p95 = round(percentile(samples, 0.95) * 1000, 1)
            reading = readings.get(name)
            failures = reading.failed - current.failed_before if reading is not None else 0
            ring.put(index, Point(current.slots, current.queue, p50, p95, max(failures, 0)))
        self.closed += 1

    def document(self) -> dict[str, Any]:
        """The ``GET /history`` document: per node, each series, oldest first."""
        nodes = []
        for name, ring in self.rings.items():
            points = ring.values()
            entry: dict[str, Any] = {"name": name}
            for series in SERIES:
                entry[series] = [None if p is None else getattr(p, series) for p in points]
            nodes.append(entry)
        return {
            "interval_s": self.interval,
            "points": self.points,
            "closed": self.closed,
            "nodes": nodes,
        }
