"""The dashboard's history rings and their per-interval points (``service/history.py``).

Pure: tables of looks with an explicit ``now``, no Trio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_core_purity import offending_imports

from trio_failover.service import history
from trio_failover.service.history import (
    History,
    Point,
    Reading,
    Ring,
    percentile,
)

# -- the ring --------------------------------------------------------------------------

RING_CASES: list[tuple[str, list[tuple[int, str]], list[str | None], int | None]] = [
    ("empty", [], [None, None, None], None),
    ("one value, the newest last", [(7, "a")], [None, None, "a"], 7),
    ("in order", [(1, "a"), (2, "b"), (3, "c")], ["a", "b", "c"], 3),
    ("wraps: the oldest falls out", [(1, "a"), (2, "b"), (3, "c"), (4, "d")], ["b", "c", "d"], 4),
    ("a skipped interval is None", [(1, "a"), (3, "c")], ["a", None, "c"], 3),
    ("a gap longer than the ring", [(1, "a"), (2, "b"), (10, "j")], [None, None, "j"], 10),
    ("a gap of exactly the ring", [(1, "a"), (4, "d")], [None, None, "d"], 4),
    (
        "an older interval still held is rewritten",
        [(2, "b"), (3, "c"), (2, "B")],
        [None, "B", "c"],
        3,
    ),
    ("one the ring no longer holds is ignored", [(5, "e"), (2, "b")], [None, None, "e"], 5),
    ("the same interval twice: the last wins", [(4, "d"), (4, "D")], [None, None, "D"], 4),
    ("negative interval numbers", [(-2, "x"), (-1, "y")], [None, "x", "y"], -1),
]


@pytest.mark.parametrize(
    ("puts", "values", "newest"),
    [case[1:] for case in RING_CASES],
    ids=[case[0] for case in RING_CASES],
)
def test_ring(puts: list[tuple[int, str]], values: list[str | None], newest: int | None) -> None:
    ring: Ring[str] = Ring(3)
    for index, value in puts:
        ring.put(index, value)
    assert ring.values() == values
    assert ring.newest == newest


def test_a_ring_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Ring(0)


# -- percentiles -----------------------------------------------------------------------

PERCENTILE_CASES = [
    ([5.0], 0.5, 5.0),
    ([5.0], 0.95, 5.0),
    ([1.0, 2.0], 0.5, 1.0),
    ([1.0, 2.0], 0.95, 2.0),
    ([1.0, 2.0, 3.0], 0.5, 2.0),
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
    ([float(n) for n in range(1, 21)], 0.95, 19.0),  # rank ceil(19.0) = 19, not 20
    ([float(n) for n in range(1, 101)], 0.95, 95.0),
    ([float(n) for n in range(1, 101)], 0.5, 50.0),
    ([float(n) for n in range(1, 11)], 1.0, 10.0),
    ([float(n) for n in range(1, 11)], 0.01, 1.0),
]


@pytest.mark.parametrize(("ordered", "fraction", "expected"), PERCENTILE_CASES)
def test_percentile_is_the_nearest_rank(
    ordered: list[float], fraction: float, expected: float
) -> None:
    assert percentile(ordered, fraction) == expected


# -- looks and points ------------------------------------------------------------------

IDLE = Reading(in_flight=0, queued=0, failed=0)


def series(history: History, node: str, name: str) -> list[Any]:
    [entry] = [n for n in history.document()["nodes"] if n["name"] == node]
    values: list[Any] = entry[name]
    return values


def point(history: History, node: str) -> Point | None:
    return history.rings[node].values()[-1]


def test_the_first_look_opens_an_interval_and_closes_nothing() -> None:
    history = History(["a"], interval=10.0, points=4)
    history.observe(3.0, {"a": Reading(2, 1, 0)})
    assert history.closed == 0
    assert history.document() == {
        "interval_s": 10.0,
        "points": 4,
        "closed": 0,
        "nodes": [
            {
                "name": "a",
                "slots": [None] * 4,
                "queue": [None] * 4,
                "ttfb_p50_ms": [None] * 4,
                "ttfb_p95_ms": [None] * 4,
                "failures": [None] * 4,
            }
        ],
    }


# Looks (now, in_flight, queued, failed so far) of node "a" through two
# intervals of 10 s, and the points they close to.
LOOK_CASES: list[tuple[str, list[tuple[float, int, int, int]], list[Point | None]]] = [
    (
        "peaks of the looks, failures as the growth of the count",
        [(0.0, 1, 0, 5), (4.0, 3, 2, 6), (9.0, 2, 1, 8), (10.0, 0, 0, 9), (20.0, 0, 0, 9)],
        [Point(3, 2, None, None, 4), Point(0, 0, None, None, 0)],
    ),
    (
        "a look at the boundary belongs to the new interval",
        [(0.0, 0, 0, 0), (10.0, 4, 4, 0), (20.0, 0, 0, 0)],
        [Point(0, 0, None, None, 0), Point(4, 4, None, None, 0)],
    ),
    (
        "an interval without a look is no point",
        [(0.0, 1, 0, 0), (25.0, 2, 0, 3), (30.0, 0, 0, 3)],
        [Point(1, 0, None, None, 3), None, Point(2, 0, None, None, 0)],
    ),
    (
        "rounding: 0.1 s looks close at the third boundary exactly",
        [(0.1 * n, n % 3, 0, 0) for n in range(301)],
        [Point(2, 0, None, None, 0)] * 3,
    ),
]


@pytest.mark.parametrize(
    ("looks", "points"), [case[1:] for case in LOOK_CASES], ids=[case[0] for case in LOOK_CASES]
)
def test_looks_close_into_points(
    looks: list[tuple[float, int, int, int]], points: list[Point | None]
) -> None:
    history = History(["a"], interval=10.0, points=len(points))
    for now, in_flight, queued, failed in looks:
        history.observe(now, {"a": Reading(in_flight, queued, failed)})
    assert history.rings["a"].values() == points


def test_the_commits_of_an_interval_give_its_time_to_first_byte() -> None:
    history = History(["a", "b"], interval=10.0, points=3)
    history.observe(0.0, {"a": IDLE, "b": IDLE})
    history.ttfb["a"].extend([0.3, 0.1, 0.2, 2.0])  # as Metrics.committed appends them
    history.observe(10.0, {"a": IDLE, "b": IDLE})
    assert point(history, "a") == Point(0, 0, 200.0, 2000.0, 0)
    assert point(history, "b") == Point(0, 0, None, None, 0)
    assert history.ttfb == {"a": [], "b": []}  # a new list for the next interval
    history.ttfb["a"].append(0.0456)
    history.observe(20.0, {"a": IDLE, "b": IDLE})
    assert series(history, "a", "ttfb_p50_ms") == [None, 200.0, 45.6]
    assert series(history, "a", "ttfb_p95_ms") == [None, 2000.0, 45.6]


def test_a_node_missing_from_the_looks_is_idle() -> None:
    history = History(["a", "b"], interval=10.0, points=2)
    history.observe(0.0, {"a": Reading(1, 0, 0)})
    history.observe(5.0, {"a": Reading(1, 0, 0), "b": Reading(2, 0, 7)})
    history.observe(10.0, {"a": IDLE})
    assert point(history, "b") == Point(2, 0, None, None, 0)
    # b came back: its count grew from 7 to 9 over the interval.
    history.observe(15.0, {"a": IDLE, "b": Reading(0, 0, 9)})
    history.observe(20.0, {"a": IDLE, "b": Reading(0, 0, 9)})
    assert point(history, "b") == Point(0, 0, None, None, 0)


def test_a_count_that_went_down_counts_no_failures() -> None:
    history = History(["a"], interval=10.0, points=1)
    history.observe(0.0, {"a": Reading(0, 0, 5)})
    history.observe(10.0, {"a": Reading(0, 0, 2)})
    assert point(history, "a") == Point(0, 0, None, None, 0)


def test_fifteen_minutes_of_looks_fill_the_ring_and_no_more() -> None:
    history = History(["a"])  # the defaults: 90 points of 10 s
    now = 1000.0
    for _ in range(95 * 10 + 1):
        history.observe(now, {"a": Reading(1, 0, 0)})
        now = history.next_look(now)
    assert history.closed == 95
    assert series(history, "a", "slots") == [1] * 90
    assert len(history.document()["nodes"][0]["failures"]) == 90


NEXT_LOOK_CASES = [
    (0.0, 1.0),
    (0.5, 1.0),
    (1.0, 2.0),
    (9.9999999999, 10.0 + 1.0),  # within rounding of 10: the look at 10 was it
    (123.4, 124.0),
]


@pytest.mark.parametrize(("now", "expected"), NEXT_LOOK_CASES)
def test_the_next_look_is_the_next_tenth_of_an_interval(now: float, expected: float) -> None:
    assert History(["a"], interval=10.0).next_look(now) == pytest.approx(expected)


@pytest.mark.parametrize(("interval", "looks"), [(0.0, 10), (-1.0, 10), (10.0, 0)])
def test_bad_intervals_are_refused(interval: float, looks: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        History(["a"], interval=interval, looks=looks)


def test_the_history_module_is_pure() -> None:
    # As pure as the core (standard library only, no clock, no I/O), though
    # it serves the dashboard from service/.
    source = Path(history.__file__).read_text()
    assert offending_imports(source) == []


def test_the_rings_follow_the_node_list_of_a_reload() -> None:
    history = History(["a", "b"], interval=10.0, points=3)
    ttfb = history.ttfb
    history.observe(0.0, {"a": Reading(1, 0, 0), "b": Reading(2, 0, 0)})
    history.observe(10.0, {"a": Reading(3, 0, 0)})
    history.follow(["a", "c"])  # a reload: b removed, c added
    history.observe(10.0, {"a": Reading(3, 0, 0), "c": Reading(4, 0, 0)})
    history.observe(20.0, {"a": Reading(0, 0, 0), "c": Reading(0, 0, 0)})
    document = history.document()
    assert [node["name"] for node in document["nodes"]] == ["a", "c"]
    assert [node["slots"] for node in document["nodes"]] == [[None, 1, 3], [None, None, 4]]
    assert history.ttfb is ttfb  # the metrics' reference stays valid
    assert sorted(ttfb) == ["a", "c"]
