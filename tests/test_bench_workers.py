"""scripts/bench_workers.py's own arithmetic (the timings are not tested): the best step
within the bound, and the split of a step's CPU over the workers."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench_workers() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module("bench_workers")
    finally:
        sys.path.remove(str(SCRIPTS))


def test_the_best_step_is_the_largest_within_the_bound(bench_workers: ModuleType) -> None:
    step = bench_workers.bench.StreamStep

    def taken(streams: int, p99: float) -> object:
        return step(streams, streams, chunks=streams * 10, seconds=1.0, p99_ms=p99)

    ladder = bench_workers.Ladder([taken(200, 3.0), taken(300, 24.0), taken(400, 90.0)])
    assert ladder.best.streams == 300
    assert bench_workers.Ladder([taken(200, 30.0)]).best is None


def test_the_split_names_each_workers_share_and_nothing_for_one_process(
    bench_workers: ModuleType,
) -> None:
    before = {10: 1.0, 11: 5.0, 12: 7.0}  # the supervisor, then its workers by pid
    after = {10: 1.0, 11: 6.0, 12: 10.0}
    assert bench_workers.split(before, after) == "  split 0/25/75%"
    assert bench_workers.split({10: 1.0}, {10: 2.0}) == ""
