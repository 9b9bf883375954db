"""Table tests of the pure liveness decisions (trio_failover.core.liveness), SPEC 5.5."""

from __future__ import annotations

import math

import pytest

from trio_failover.core.liveness import (
    CheckRecord,
    Decision,
    Step,
    after_check,
    at_window_end,
    check_timeout,
    passes,
    reuses_pass,
    window_end,
)
from trio_failover.core.outcome import Outcome

CHECK = Decision(Step.CHECK)
WAIT = Decision(Step.WAIT)
TIMED_OUT = Decision(Step.GIVE_UP, Outcome.HEADER_TIMEOUT)
UNRESPONSIVE = Decision(Step.GIVE_UP, Outcome.UNRESPONSIVE)


@pytest.mark.parametrize(
    ("header_timeout", "expected"),
    [(2.0, 2.0), (10.0, 10.0), (120.0, 10.0), (0.5, 0.5)],
)
def test_check_timeout_is_the_header_timeout_capped_at_ten_seconds(
    header_timeout: float, expected: float
) -> None:
    assert check_timeout(header_timeout) == expected


@pytest.mark.parametrize(
    ("now", "header_timeout", "final", "expected"),
    [
        (2.0, 2.0, 600.0, 4.0),
        (599.0, 2.0, 600.0, 600.0),  # the last window ends at the final deadline
        (7.0, 2.0, math.inf, 9.0),  # a first body byte: no final deadline
    ],
)
def test_window_end(now: float, header_timeout: float, final: float, expected: float) -> None:
    assert window_end(now, header_timeout, final) == expected


@pytest.mark.parametrize(
    ("now", "final", "expected"),
    [
        (2.0, 600.0, CHECK),
        (600.0, 600.0, TIMED_OUT),
        (601.0, 600.0, TIMED_OUT),
        (9.0, math.inf, CHECK),
    ],
)
def test_at_window_end(now: float, final: float, expected: Decision) -> None:
    assert at_window_end(now, final) == expected


@pytest.mark.parametrize(
    ("passed", "now", "final", "expected"),
    [
        (True, 4.0, 600.0, WAIT),
        (False, 4.0, 600.0, UNRESPONSIVE),
        (True, 600.0, 600.0, TIMED_OUT),  # the node had its whole time
        (False, 600.0, 600.0, UNRESPONSIVE),
        (True, 1e9, math.inf, WAIT),  # after the head a passing node waits on forever
    ],
)
def test_after_check(passed: bool, now: float, final: float, expected: Decision) -> None:
    assert after_check(passed, now, final) == expected


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
