"""Table tests of a discovery check's questions and schedule (core.checks)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_failover.core.checks import (
    CHECK_JITTER,
    HealthAnswer,
    down_recheck_delay,
    first_check_delays,
    inventory_waits,
    judge_health,
    next_check_at,
    tags_answer,
)
from trio_failover.core.inventory import (
    MAX_LISTING_BYTES,
    CheckFailure,
    CheckVerdict,
    Health,
    judge_check,
)


def listing(*ids: str) -> bytes:
    return json.dumps(
        {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}
    ).encode()


def down(error: str, result: str) -> CheckVerdict:
    return CheckVerdict(Health.DOWN, "health_check", False, None, error, result)


GO_ON_READY = HealthAnswer(None, True)  # /health 2xx: ready, /v1/models for the inventory
GO_ON_NO_ROUTE = HealthAnswer(None, False)  # no health route: /v1/models gives the health


# -- question 1: GET /health -> what it settles ---------------------------------------

HEALTH = [
    pytest.param({"status": 200}, GO_ON_READY, id="200-ready"),
    pytest.param({"status": 204}, GO_ON_READY, id="204-ready"),
    pytest.param({"status": 404}, GO_ON_NO_ROUTE, id="404-no-route"),  # llama-cpp-python, Ollama
    pytest.param({"status": 401}, GO_ON_NO_ROUTE, id="401-no-route"),
    pytest.param({"status": 405}, GO_ON_NO_ROUTE, id="405-no-route"),
    pytest.param({"status": 302}, GO_ON_NO_ROUTE, id="redirect-no-route"),
    pytest.param({"failure": CheckFailure.NOT_HTTP}, GO_ON_NO_ROUTE, id="not-http-no-route"),
    pytest.param(
        {"status": 503, "detail": "x"},
        HealthAnswer(down("health check: /health answered 503 (x)", "server_error"), False),
        id="503-loading-down",
    ),
    pytest.param(
        {"status": 500},
        HealthAnswer(down("health check: /health answered 500", "server_error"), False),
        id="500-down",
    ),
    pytest.param(
        {"failure": CheckFailure.CONNECT_FAILED, "detail": "connect: refused"},
        HealthAnswer(
            down("health check cannot connect (connect: refused)", "connect_failed"), False
        ),
        id="refused-down",
    ),
    pytest.param(
        {"failure": CheckFailure.CONNECT_FAILED, "streaming": True},
        HealthAnswer(down("health check cannot connect", "connect_failed"), False),
        id="refused-while-streaming-down",
    ),
    pytest.param(
        {"failure": CheckFailure.TIMED_OUT, "detail": "answer: slow"},
        HealthAnswer(down("health check: /health timed out (answer: slow)", "timed_out"), False),
        id="timeout-down",
    ),
    pytest.param(
        {"failure": CheckFailure.TIMED_OUT, "streaming": True},
        HealthAnswer(
            CheckVerdict(Health.UNCHANGED, None, False, None, None, "timeout_while_streaming"),
            False,
        ),
        id="timeout-while-streaming-does-not-count",
    ),
]


@pytest.mark.parametrize(("arguments", "expected"), HEALTH)
def test_judge_health(arguments: dict[str, object], expected: HealthAnswer) -> None:
    assert judge_health(**arguments) == expected  # type: ignore[arg-type]


def test_judge_health_needs_a_result() -> None:
    with pytest.raises(ValueError, match="failure or a status"):
        judge_health()


# -- question 2 after a /health 2xx: the inventory alone --------------------------------

READY = (Health.READY, "health_check")

AFTER_HEALTH = [
    pytest.param(
        {"status": 200, "body": listing("m1")},
        CheckVerdict(*READY, True, ("m1",), None, "ok"),
        id="list",
    ),
    pytest.param(
        {"status": 200, "body": listing()},
        CheckVerdict(*READY, True, None, None, "ok"),
        id="empty-list-unknown",
    ),
    pytest.param(
        {"status": 200, "body": b"<html>hi</html>"},
        CheckVerdict(
            *READY,
            True,
            None,
            "health check: /v1/models answered 200, not a model list: not JSON",
            "bad_body",
        ),
        id="html-unknown-still-ready",
    ),
    pytest.param(
        {"status": 404},
        CheckVerdict(*READY, True, None, "health check: /v1/models answered 404", "bad_status"),
        id="404-unknown-still-ready",
    ),
    pytest.param(
        {"status": 503},
        CheckVerdict(
            *READY, False, None, "health check: /v1/models answered 503", "models_server_error"
        ),
        id="503-kept-ready",  # /health said ready; the inventory keeps
    ),
    pytest.param(
        {"failure": CheckFailure.TIMED_OUT, "detail": "answer: slow"},
        CheckVerdict(
            *READY,
            False,
            None,
            "health check: /v1/models timed out (answer: slow)",
            "models_timed_out",
        ),
        id="timeout-kept-ready",
    ),
    pytest.param(
        {"failure": CheckFailure.CONNECT_FAILED},
        CheckVerdict(
            *READY, False, None, "health check: /v1/models cannot connect", "models_connect_failed"
        ),
        id="refused-kept-ready",
    ),
    pytest.param(
        {"failure": CheckFailure.NOT_HTTP},
        CheckVerdict(
            *READY, True, None, "health check: /v1/models answer is not HTTP/1.1", "bad_answer"
        ),
        id="not-http-unknown-ready",
    ),
]


@pytest.mark.parametrize(("arguments", "expected"), AFTER_HEALTH)
def test_judge_check_after_a_health_route(
    arguments: dict[str, object], expected: CheckVerdict
) -> None:
    assert judge_check(**arguments, health_route=True) == expected  # type: ignore[arg-type]


def test_inventory_waits_keeps_the_inventory() -> None:
    assert inventory_waits(has_route=True) == CheckVerdict(
        Health.READY, "health_check", False, None, None, "ok_inventory_waits"
    )
    assert inventory_waits(has_route=False) == CheckVerdict(
        Health.UNCHANGED, None, False, None, None, "inventory_waits"
    )


# -- question 3: GET /api/tags ------------------------------------------------------------

TAGS = [
    pytest.param(200, b'{"models": [{"name": "a:latest"}]}', [{"name": "a:latest"}], id="ollama"),
    pytest.param(200, b'{"models": null}', [], id="null-none"),
    pytest.param(200, b'{"models": []}', [], id="empty"),
    pytest.param(200, b'{"models": [1, {"name": "b"}]}', [{"name": "b"}], id="objects-only"),
    pytest.param(404, b'{"detail": "Not Found"}', None, id="404-no-route"),
    pytest.param(200, b"<html></html>", None, id="html"),
    pytest.param(200, b"[]", None, id="not-an-object"),
    pytest.param(200, b'{"models": {}}', None, id="models-not-a-list"),
    pytest.param(500, b'{"models": []}', None, id="5xx"),
]


@pytest.mark.parametrize(("status", "body", "expected"), TAGS)
def test_tags_answer(status: int, body: bytes, expected: list[dict[str, object]] | None) -> None:
    assert tags_answer(status, body) == expected


def test_tags_answer_refuses_a_huge_body() -> None:
    body = b'{"models": []}' + b" " * MAX_LISTING_BYTES
    assert tags_answer(200, body) is None


# -- the schedule ---------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 7, 50, 1000])
def test_first_checks_are_spread_within_a_second(count: int) -> None:
    delays = first_check_delays(count)
    assert len(delays) == count
    assert delays[0] == 0.0
    assert all(0.0 <= delay < 1.0 for delay in delays)
    gaps = [later - earlier for earlier, later in itertools.pairwise(delays)]
    assert all(gap == pytest.approx(1.0 / count) for gap in gaps)  # none together


def test_first_checks_of_no_nodes() -> None:
    assert first_check_delays(0) == []


@pytest.mark.parametrize(
    ("started", "finished", "interval", "jitter", "expected"),
    [
        (0.0, 0.1, 30.0, 0.0, 30.0),  # start to start, not end to start
        (0.0, 0.1, 30.0, 1.0, 27.0),  # at most 10 % early
        (0.0, 0.1, 30.0, 0.5, 28.5),
        (10.0, 20.0, 5.0, 0.0, 20.0),  # a check longer than the interval: never two at once
        (0.0, 1.0, 30.0, 7.0, 27.0),  # jitter clamped
        (0.0, 1.0, 30.0, -1.0, 30.0),
    ],
)
def test_next_check_at(
    started: float, finished: float, interval: float, jitter: float, expected: float
) -> None:
    got = next_check_at(started=started, finished=finished, interval=interval, jitter=jitter)
    assert got == pytest.approx(expected)


# down checks in a row, interval -> seconds to the next check
BACKOFF = [
    (1, 30.0, 1.0),
    (2, 30.0, 2.0),
    (3, 30.0, 4.0),
    (4, 30.0, 8.0),
    (5, 30.0, 16.0),
    (6, 30.0, 30.0),  # 32 capped at the interval
    (7, 30.0, 30.0),
    (1, 2.0, 1.0),
    (2, 2.0, 2.0),
    (3, 2.0, 2.0),  # 4 capped at a 2 s interval
    (1, 0.5, 0.5),  # an interval below a second caps the first re-check too
    (10_000, 600.0, 600.0),  # no overflow after a long outage
    (0, 30.0, 1.0),  # as the first (never called with 0 by next_check_at)
]


@pytest.mark.parametrize(("down_checks", "interval", "expected"), BACKOFF)
def test_down_recheck_delay(down_checks: int, interval: float, expected: float) -> None:
    assert down_recheck_delay(down_checks, interval) == expected


@pytest.mark.parametrize(
    ("down_checks", "finished", "expected"),
    [(1, 10.0, 11.0), (2, 11.0, 13.0), (3, 13.0, 17.0), (4, 17.0, 25.0), (5, 25.0, 41.0)],
)
def test_a_down_node_is_checked_again_from_the_end_of_its_check_without_jitter(
    down_checks: int, finished: float, expected: float
) -> None:
    got = next_check_at(
        started=finished - 10.0,
        finished=finished,
        interval=30.0,
        jitter=1.0,
        down_checks=down_checks,
    )
    assert got == expected


@given(
    st.floats(0, 1e6),
    st.floats(0, 20),
    st.floats(0.001, 3600),
    st.floats(0, 1),
)
def test_next_check_within_one_interval_never_overlapping(
    started: float, took: float, interval: float, jitter: float
) -> None:
    finished = started + took
    got = next_check_at(started=started, finished=finished, interval=interval, jitter=jitter)
    assert got >= finished
    assert got <= max(started + interval, finished)
    assert got >= started + (1 - CHECK_JITTER) * interval - 1e-6 or got == finished


@given(st.integers(1, 10_000), st.floats(0.001, 3600), st.floats(0, 1e6))
def test_a_down_node_waits_at_most_one_interval(
    down_checks: int, interval: float, finished: float
) -> None:
    got = next_check_at(
        started=finished, finished=finished, interval=interval, down_checks=down_checks
    )
    assert finished < got <= finished + interval
