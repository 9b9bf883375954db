"""Table tests of the pure liveness decisions (trio_failover.core.liveness)."""

from __future__ import annotations

import itertools
import math

import pytest

from trio_failover.core.liveness import (
    CheckRecord,
    check_timeout,
    moving,
    next_question,
    passes,
    proof_window,
    question_period,
    reuses_pass,
    revive_delay,
)

INF = math.inf


@pytest.mark.parametrize(
    ("header_timeout", "expected"),
    [(2.0, 2.0), (10.0, 10.0), (120.0, 10.0), (0.5, 0.5)],
)
def test_check_timeout_is_the_header_timeout_capped_at_ten_seconds(
    header_timeout: float, expected: float
) -> None:
    assert check_timeout(header_timeout) == expected


@pytest.mark.parametrize(
    ("interval", "header_timeout", "watched", "expected"),
    [
        (10.0, 120.0, False, 10.0),  # the default: every interval
        (10.0, 120.0, True, 10.0),
        (10.0, 2.0, True, 2.0),  # a watched wait also asks at each header timeout
        (10.0, 2.0, False, 10.0),  # a streamed head: its deadline is a verdict, not a question
        (0.0, 120.0, True, 120.0),  # 0: only at the deadlines
        (0.0, 120.0, False, INF),
        (30.0, 20.0, True, 20.0),
    ],
)
def test_question_period(
    interval: float, header_timeout: float, watched: bool, expected: float
) -> None:
    assert question_period(interval, header_timeout, watched=watched) == expected


@pytest.mark.parametrize(
    ("since", "last", "period", "expected"),
    [
        (0.0, -INF, 10.0, 10.0),  # the first question: one period of silence
        (0.0, 10.0, 10.0, 20.0),  # then at whole periods
        (0.0, 20.0, 10.0, 30.0),
        (5.0, 10.0, 10.0, 15.0),  # a byte at 5 began a new silence
        (0.0, 30.000000001, 10.0, 40.0),
        (0.1, 30.1, 10.0, 40.1),  # since + k * period, without rounding drift
        (0.0, -INF, INF, INF),  # a wait that never asks
    ],
)
def test_next_question(since: float, last: float, period: float, expected: float) -> None:
    assert next_question(since, last, period) == pytest.approx(expected)
    assert next_question(since, last, period) > last


def test_next_question_never_repeats_a_question_over_many_periods() -> None:
    last, since = -INF, 0.1
    asked = []
    for _ in range(1000):
        last = next_question(since, last, 0.3)
        asked.append(last)
    assert all(b > a for a, b in itertools.pairwise(asked))
    assert asked[-1] == pytest.approx(0.1 + 1000 * 0.3)


@pytest.mark.parametrize(("interval", "expected"), [(10.0, 10.0), (3.0, 3.0), (0.0, 10.0)])
def test_proof_window_is_the_interval_or_ten_seconds(interval: float, expected: float) -> None:
    assert proof_window(interval) == expected


@pytest.mark.parametrize(
    ("silent_since", "now", "expected"),
    [
        (None, 100.0, True),  # relaying a chunk right now
        (95.0, 100.0, True),
        (90.0, 100.0, False),  # a whole window of silence: proves nothing
        (80.0, 100.0, False),
    ],
)
def test_a_stream_moves_when_it_relayed_a_byte_within_the_window(
    silent_since: float | None, now: float, expected: bool
) -> None:
    assert moving(silent_since, now, 10.0) is expected


@pytest.mark.parametrize(
    ("failed", "expected"),
    [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)],
)
def test_revive_delay_backs_off_to_thirty_seconds(failed: int, expected: float) -> None:
    assert revive_delay(failed) == expected


@pytest.mark.parametrize(
    ("passed_at", "now", "expected"),
    [(2.0, 2.0, True), (2.0, 2.999, True), (2.0, 3.0, False), (-math.inf, 0.0, False)],
)
def test_a_pass_is_reused_for_less_than_a_second(
    passed_at: float, now: float, expected: bool
) -> None:
    assert reuses_pass(passed_at, now) is expected


@pytest.mark.parametrize(
    ("status", "expected"), [(200, True), (503, True), (404, True), (None, False)]
)
def test_any_status_passes(status: int | None, expected: bool) -> None:
    assert passes(status) is expected


def test_check_record_json_has_its_age() -> None:
    record = CheckRecord("liveness", False, None, "connect: refused", at=10.0)
    assert record.to_json(12.3456) == {
        "kind": "liveness",
        "ok": False,
        "status": None,
        "error": "connect: refused",
        "age_s": 2.346,
    }
    assert record.to_json(9.0)["age_s"] == 0.0
