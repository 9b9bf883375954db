"""Table-driven tests of attempt verdicts (trio_failover.outcome)."""

from __future__ import annotations

import calendar
import json
import time
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path

import pytest

from trio_failover.core.cooldown import ends_cooldown
from trio_failover.core.outcome import (
    RULES,
    AttemptRecord,
    HeadAction,
    Outcome,
    Verdict,
    after_commit,
    classify_head,
    error_code,
    error_names,
    fails_over_on,
    failure_code,
    failure_status,
    judge,
    may_pool,
    parse_retry_after,
    retry_after_of,
)

RHT = 120.0  # the response-header timeout of every case below

# outcome -> (fail_over, cooldown, timed_out) with no Retry-After.
VERDICTS: dict[Outcome, tuple[bool, float, bool]] = {
    # Before commit: fast errors fail over at once and cost the node nothing.
    Outcome.CONNECT_FAILED: (True, 0.0, False),
    Outcome.CONNECT_TIMEOUT: (True, 0.0, True),
    Outcome.TLS_ERROR: (True, 0.0, False),
    Outcome.RESET: (True, 0.0, False),
    Outcome.CLOSED_EARLY: (True, 0.0, False),
    Outcome.PROTOCOL_ERROR: (True, 0.0, False),
    Outcome.RETRYABLE_RESPONSE: (True, 0.0, False),
    # Before commit: stalls and a dead peer demote for one header timeout.
    Outcome.HEADER_TIMEOUT: (True, RHT, True),
    Outcome.FIRST_BODY_TIMEOUT: (True, RHT, True),
    Outcome.DEAD_PEER: (True, RHT, True),
    # No head and no answer to GET /health either: timed out, and the check
    # marked the node down (no cooldown besides: down demotes it already).
    Outcome.UNRESPONSIVE: (True, 0.0, True),
    # Never the node's fault, or already committed: no failover.
    Outcome.CLIENT_ABORT: (False, 0.0, False),
    Outcome.SHUTDOWN: (False, 0.0, False),  # the proxy stopped (end of a drain)
    Outcome.COMPLETED: (False, 0.0, False),
    Outcome.STREAM_BROKEN: (False, 0.0, False),
    # After commit a stall still demotes, but nothing is replayed.
    Outcome.STREAM_IDLE_TIMEOUT: (False, RHT, True),
    # A stale inventory: fail over, no cooldown; the node is asked again instead.
    Outcome.MODEL_NOT_FOUND: (True, 0.0, False),
}


def test_every_outcome_has_a_verdict_row() -> None:
    assert set(VERDICTS) == set(Outcome)


@pytest.mark.parametrize(("outcome", "expected"), VERDICTS.items(), ids=[str(o) for o in VERDICTS])
def test_judge(outcome: Outcome, expected: tuple[bool, float, bool]) -> None:
    fail_over, cooldown, timed_out = expected
    assert judge(outcome, response_header_timeout=RHT) == Verdict(
        fail_over=fail_over,
        cooldown=cooldown,
        timed_out=timed_out,
        recheck=outcome is Outcome.MODEL_NOT_FOUND,
    )


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome.HEADER_TIMEOUT,
        Outcome.FIRST_BODY_TIMEOUT,
        Outcome.DEAD_PEER,
        Outcome.STREAM_IDLE_TIMEOUT,
    ],
)
@pytest.mark.parametrize("timeout", [0.25, 2.5, 600.0])
def test_stall_cooldown_is_one_header_timeout(outcome: Outcome, timeout: float) -> None:
    assert judge(outcome, response_header_timeout=timeout).cooldown == timeout


# (Retry-After seconds, expected cooldown) for a retryable 429 with RHT = 120.
RETRY_AFTER = [
    pytest.param(None, 0.0, id="no-header"),
    pytest.param(0.0, 0.0, id="zero"),
    pytest.param(0.5, 0.5, id="half-second"),
    pytest.param(5.0, 5.0, id="short"),
    pytest.param(119.0, 119.0, id="just-under-cap"),
    pytest.param(120.0, 120.0, id="at-cap"),
    pytest.param(3600.0, 120.0, id="capped-at-header-timeout"),
]


@pytest.mark.parametrize(("retry_after", "cooldown"), RETRY_AFTER)
def test_retry_after_cools_for_at_most_one_header_timeout(
    retry_after: float | None, cooldown: float
) -> None:
    verdict = judge(
        Outcome.RETRYABLE_RESPONSE, response_header_timeout=RHT, retry_after=retry_after
    )
    assert verdict == Verdict(fail_over=True, cooldown=cooldown, timed_out=False)


@pytest.mark.parametrize(
    ("outcome", "cooldown"),
    [
        pytest.param(Outcome.CONNECT_FAILED, 0.0, id="fast-error-stays-uncooled"),
        pytest.param(Outcome.HEADER_TIMEOUT, RHT, id="stall-keeps-its-length"),
        pytest.param(Outcome.COMPLETED, 0.0, id="success-stays-uncooled"),
    ],
)
def test_retry_after_only_counts_for_retryable_responses(outcome: Outcome, cooldown: float) -> None:
    assert judge(outcome, response_header_timeout=RHT, retry_after=5.0).cooldown == cooldown


# -- classify_head ------------------------------------------------------------------

DEFAULT_STATUS = frozenset({429, 500, 502, 503, 504})
DEFAULT_CODES = frozenset({"context_length_exceeded"})

HEADS = [
    pytest.param(200, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.COMMIT, id="200"),
    pytest.param(204, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.COMMIT, id="204"),
    pytest.param(301, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.COMMIT, id="301"),
    pytest.param(304, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.COMMIT, id="304"),
    pytest.param(399, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.COMMIT, id="399"),
    pytest.param(400, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.INSPECT, id="400-inspect"),
    pytest.param(404, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.INSPECT, id="404-inspect"),
    pytest.param(499, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.INSPECT, id="499-inspect"),
    pytest.param(429, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.RETRY, id="429-retry"),
    pytest.param(500, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.RETRY, id="500-retry"),
    pytest.param(503, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.RETRY, id="503-retry"),
    pytest.param(504, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.RETRY, id="504-retry"),
    pytest.param(501, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.COMMIT, id="501-not-listed"),
    pytest.param(505, DEFAULT_STATUS, DEFAULT_CODES, HeadAction.COMMIT, id="505-not-listed"),
    pytest.param(400, DEFAULT_STATUS, frozenset(), HeadAction.COMMIT, id="400-no-codes"),
    # A 404 may say "model not found" (a stale inventory) whatever the codes.
    pytest.param(404, DEFAULT_STATUS, frozenset(), HeadAction.INSPECT, id="404-no-codes"),
    pytest.param(404, frozenset({404}), frozenset(), HeadAction.RETRY, id="404-listed"),
    pytest.param(429, DEFAULT_STATUS, frozenset(), HeadAction.RETRY, id="429-no-codes"),
    pytest.param(400, frozenset({400}), DEFAULT_CODES, HeadAction.RETRY, id="listed-4xx-retry"),
    pytest.param(503, frozenset(), DEFAULT_CODES, HeadAction.COMMIT, id="no-retry-status"),
    pytest.param(500, frozenset(), DEFAULT_CODES, HeadAction.COMMIT, id="5xx-never-inspected"),
    pytest.param(400, DEFAULT_STATUS, ["a", "b"], HeadAction.INSPECT, id="codes-as-list"),
]


@pytest.mark.parametrize(("status", "retry_status", "codes", "action"), HEADS)
def test_classify_head(
    status: int, retry_status: frozenset[int], codes: frozenset[str], action: HeadAction
) -> None:
    assert classify_head(status, retry_status=retry_status, retry_error_codes=codes) is action


# -- error_code -----------------------------------------------------------------------

ERROR_BODIES = [
    pytest.param(
        b'{"error": {"message": "This model\'s maximum context length is 8192 tokens.",'
        b' "type": "invalid_request_error", "param": "messages",'
        b' "code": "context_length_exceeded"}}',
        "context_length_exceeded",
        id="openai",
    ),
    pytest.param(b'{"error":{"code":"rate_limit_exceeded"}}', "rate_limit_exceeded", id="compact"),
    pytest.param(b' \n{"error": {"code": "x"}}\n', "x", id="whitespace-around"),
    pytest.param(b'{"error": {"code": ""}}', "", id="empty-code-is-a-code"),
    pytest.param(b'{"error": {"code": null, "message": "m"}}', None, id="null-code"),
    pytest.param(b'{"error": {"message": "m", "type": "t"}}', None, id="missing-code"),
    pytest.param(b'{"error": {"code": 400, "type": "BadRequestError"}}', None, id="numeric-code"),
    pytest.param(b'{"error": {"code": true}}', None, id="boolean-code"),
    pytest.param(b'{"error": {"code": {"nested": "x"}}}', None, id="object-code"),
    pytest.param(b'{"error": "model \\"x\\" not found"}', None, id="ollama-string-error"),
    pytest.param(b'{"error": ["a", "b"]}', None, id="error-array"),
    # vLLM's errors before they were wrapped in "error": the document is the error.
    pytest.param(b'{"object": "error", "code": "x"}', "x", id="top-level-object-error"),
    pytest.param(b'{"code": "x"}', None, id="top-level-code-without-object-error"),
    pytest.param(b'{"object": "list", "code": "x"}', None, id="top-level-code-of-another-object"),
    pytest.param(b'{"error": "x", "object": "error", "code": "x"}', None, id="error-string-wins"),
    pytest.param(b'[{"error": {"code": "x"}}]', None, id="array"),
    pytest.param(b'"context_length_exceeded"', None, id="json-string"),
    pytest.param(b"42", None, id="json-number"),
    pytest.param(b"null", None, id="json-null"),
    pytest.param(b"", None, id="empty"),
    pytest.param(b"<html><body>Bad Request</body></html>", None, id="html"),
    pytest.param(b'{"error": {"code": "x"', None, id="truncated"),
    pytest.param(b'{"error": {"code": "\xff\xfe"}}', None, id="bad-utf8"),
    pytest.param(b"[" * 100_000, None, id="deeply-nested"),
    pytest.param(b'{"a":' * 50_000, None, id="deeply-nested-objects"),
]


@pytest.mark.parametrize(("body", "code"), ERROR_BODIES)
def test_error_code(body: bytes, code: str | None) -> None:
    assert error_code(body) == code


# -- the engines' own error answers (--retry-error-codes) ---------------------------------

ENGINES = Path(__file__).resolve().parent / "data" / "engines"


def engine_answer(name: str) -> bytes:
    """An engine's error body: recorded from the real engine, or from its source (vLLM)."""
    return (ENGINES / name).read_bytes()


CONTEXT = "context_length_exceeded"

# body -> the names it goes by: its string error.code, its error.type, then
# the name of an engine's own answer.
ERROR_NAMES = [
    pytest.param(
        engine_answer("llama-server/context-exceeded.json"),
        ("exceed_context_size_error", CONTEXT),
        id="llama-server-recorded",
    ),
    pytest.param(
        engine_answer("llama-cpp-python/context-exceeded.json"),
        (CONTEXT, "invalid_request_error"),
        id="llama-cpp-python-recorded",
    ),
    pytest.param(
        engine_answer("vllm/context-exceeded.json"),
        ("BadRequestError", CONTEXT),
        id="vllm",
    ),
    pytest.param(
        engine_answer("vllm/context-exceeded-v0.json"),
        ("BadRequestError", CONTEXT),
        id="vllm-before-the-error-wrapper",
    ),
    pytest.param(
        b'{"error": {"message": "\'max_tokens\' or \'max_completion_tokens\' is too large:'
        b" 8000. This model's maximum context length is 4096 tokens and your request has"
        b' 2778 input tokens (8000 > 4096 - 2778).", "type": "BadRequestError",'
        b' "param": "max_tokens", "code": 400}}',
        ("BadRequestError", CONTEXT),
        id="vllm-prompt-and-max-tokens-over-the-context",
    ),
    pytest.param(
        b'{"error": {"message": "This model\'s maximum context length is 8192 tokens.",'
        b' "type": "invalid_request_error", "code": "context_length_exceeded"}}',
        (CONTEXT, "invalid_request_error"),
        id="openai-once-each",
    ),
    pytest.param(
        b'{"error": {"code": 400, "message": "MAXIMUM CONTEXT LENGTH IS 8", "type": "t"}}',
        ("t", CONTEXT),
        id="message-in-any-case",
    ),
    pytest.param(
        b'{"error": {"code": 400, "message": "Missing prompt", "type": "invalid_request_error"}}',
        ("invalid_request_error",),
        id="llama-server-other-400",
    ),
    pytest.param(
        b'{"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}',
        ("not_found_error",),
        id="llama-server-404",
    ),
    pytest.param(
        b'{"error": {"code": 400, "type": "exceed_context_size_errors", "message": "m"}}',
        ("exceed_context_size_errors",),
        id="type-must-be-exact",
    ),
    pytest.param(
        b'{"error": {"code": 400, "type": ["exceed_context_size_error"],'
        b' "message": {"maximum context length is": 1}}}',
        (),
        id="type-and-message-must-be-strings",
    ),
    pytest.param(b'{"error": {"code": "x", "type": "x"}}', ("x",), id="code-and-type-alike"),
    pytest.param(b'{"detail": "Not Found"}', (), id="fastapi-404"),
    pytest.param(b'{"error": "model \\"x\\" not found"}', (), id="ollama-string-error"),
    pytest.param(b"maximum context length is 4", (), id="not-json"),
    pytest.param(b"[" * 100_000, (), id="deeply-nested"),
]


@pytest.mark.parametrize(("body", "names"), ERROR_NAMES)
def test_error_names(body: bytes, names: tuple[str, ...]) -> None:
    assert error_names(body) == names


@pytest.mark.parametrize(
    ("body", "listed", "code"),
    [
        # Default --retry-error-codes: every engine's context answer is one name.
        (engine_answer("llama-server/context-exceeded.json"), DEFAULT_CODES, CONTEXT),
        (engine_answer("llama-cpp-python/context-exceeded.json"), DEFAULT_CODES, CONTEXT),
        (engine_answer("vllm/context-exceeded.json"), DEFAULT_CODES, CONTEXT),
        (engine_answer("vllm/context-exceeded-v0.json"), DEFAULT_CODES, CONTEXT),
        # An error.type may be listed itself.
        (
            engine_answer("llama-server/context-exceeded.json"),
            frozenset({"exceed_context_size_error"}),
            "exceed_context_size_error",
        ),
        (
            b'{"error": {"type": "overloaded_error"}}',
            frozenset({"overloaded_error"}),
            "overloaded_error",
        ),
        # Nothing listed: the string error.code still names the answer, nothing else does.
        (engine_answer("llama-server/context-exceeded.json"), frozenset(), None),
        (engine_answer("llama-cpp-python/context-exceeded.json"), frozenset(), CONTEXT),
        (b'{"error": {"code": "rate_limited", "type": "t"}}', frozenset({"x"}), "rate_limited"),
    ],
)
def test_error_code_names_the_listed_one_first(
    body: bytes, listed: frozenset[str], code: str | None
) -> None:
    assert error_code(body, listed) == code
    assert fails_over_on(HeadAction.INSPECT, code, listed) is (code in listed)


# -- parse_retry_after -------------------------------------------------------------------

# 1994-11-06 08:49:00 UTC: the dates below are 37 s later.
WALL_NOW = float(calendar.timegm((1994, 11, 6, 8, 49, 0, 0, 0, 0)))

RETRY_AFTER_VALUES = [
    pytest.param("120", None, 120.0, id="delta"),
    pytest.param("0", None, 0.0, id="delta-zero"),
    pytest.param("007", None, 7.0, id="leading-zeros"),
    pytest.param(" 5 ", None, 5.0, id="spaces-around"),
    pytest.param("86400", WALL_NOW, 86400.0, id="delta-ignores-wall-now"),
    pytest.param("-5", None, None, id="negative"),
    pytest.param("5.5", None, None, id="fraction"),
    pytest.param("1e3", None, None, id="exponent"),
    pytest.param("", None, None, id="empty"),
    pytest.param("soon", None, None, id="word"),
    pytest.param("\u00b2", None, None, id="superscript-two"),  # isdigit(), but not a number
    pytest.param("\u0661\u0662", None, None, id="arabic-indic-digits"),
    pytest.param("Sun, 06 Nov 1994 08:49:37 GMT", WALL_NOW, 37.0, id="imf-fixdate"),
    pytest.param("Sunday, 06-Nov-94 08:49:37 GMT", WALL_NOW, 37.0, id="rfc850-date"),
    pytest.param("Sun Nov  6 08:49:37 1994", WALL_NOW, 37.0, id="asctime-date"),
    pytest.param("Sun, 06 Nov 1994 08:49:37 -0000", WALL_NOW, 37.0, id="unknown-zone"),
    pytest.param("Sun, 06 Nov 1994 08:40:00 GMT", WALL_NOW, 0.0, id="date-in-the-past"),
    pytest.param("Sun, 06 Nov 1994 08:49:37 GMT", None, None, id="date-without-date-header"),
    pytest.param("Sun, 99 Foo 1994 99:99:99 GMT", WALL_NOW, None, id="garbage-date"),
    pytest.param("Sun, 06 Nov 1994 08:49:37 +9999", WALL_NOW, None, id="bad-zone"),
    pytest.param("tomorrow", WALL_NOW, None, id="word-with-wall-now"),
]


@pytest.fixture
def _local_zone_far_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run with the process in UTC-5, so a date read as local time is 5 hours off."""
    monkeypatch.setenv("TZ", "XST+05")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("_local_zone_far_from_utc")
@pytest.mark.parametrize(("value", "wall_now", "seconds"), RETRY_AFTER_VALUES)
def test_parse_retry_after(value: str, wall_now: float | None, seconds: float | None) -> None:
    # The reference "now" reaches the parser as the response's Date header.
    date = None if wall_now is None else formatdate(wall_now, usegmt=True)
    assert parse_retry_after(value, date=date) == seconds


def test_retry_after_date_is_measured_against_the_date_header_not_a_clock() -> None:
    # A node whose clock is a day ahead still means "in 30 seconds".
    assert (
        parse_retry_after("Mon, 30 Nov 2026 12:00:30 GMT", date="Mon, 30 Nov 2026 12:00:00 GMT")
        == 30.0
    )
    assert parse_retry_after("Mon, 30 Nov 2026 12:00:30 GMT", date="not a date") is None


# -- AttemptRecord and the final status ---------------------------------------------------

TIMED_OUT = {
    Outcome.CONNECT_TIMEOUT,
    Outcome.HEADER_TIMEOUT,
    Outcome.FIRST_BODY_TIMEOUT,
    Outcome.DEAD_PEER,
    Outcome.UNRESPONSIVE,  # the node answered nothing in time: 504, as a stall
}


@pytest.mark.parametrize("outcome", list(Outcome), ids=str)
def test_attempt_timed_out(outcome: Outcome) -> None:
    record = AttemptRecord(node="a", outcome=outcome, elapsed=1.0)
    assert record.timed_out is (outcome in TIMED_OUT)
    # Before commit, the record and the verdict agree on what was a deadline.
    verdict = judge(outcome, response_header_timeout=RHT)
    if verdict.fail_over:
        assert record.timed_out is verdict.timed_out


RECORDS = [
    pytest.param(
        AttemptRecord(node="gpu-a", outcome=Outcome.HEADER_TIMEOUT, elapsed=120.0),
        {"node": "gpu-a", "outcome": "header_timeout", "elapsed_ms": 120000.0},
        id="minimal",
    ),
    pytest.param(
        AttemptRecord(node="gpu-b", outcome=Outcome.CONNECT_FAILED, elapsed=0.01234567),
        {"node": "gpu-b", "outcome": "connect_failed", "elapsed_ms": 12.3},
        id="rounded-to-a-tenth-ms",
    ),
    pytest.param(
        AttemptRecord(
            node="gpu-c",
            outcome=Outcome.RETRYABLE_RESPONSE,
            elapsed=0.5,
            status=429,
            detail="answered 429",
        ),
        {
            "node": "gpu-c",
            "outcome": "retryable_response",
            "elapsed_ms": 500.0,
            "status": 429,
            "detail": "answered 429",
        },
        id="with-status-and-detail",
    ),
    pytest.param(
        AttemptRecord(node="gpu-d", outcome=Outcome.RESET, elapsed=0.0, status=None, detail=""),
        {"node": "gpu-d", "outcome": "reset", "elapsed_ms": 0.0},
        id="empty-detail-left-out",
    ),
]


@pytest.mark.parametrize(("record", "document"), RECORDS)
def test_attempt_to_json(record: AttemptRecord, document: dict[str, object]) -> None:
    item = record.to_json()
    assert item == document
    assert type(item["outcome"]) is str  # a plain string, not the enum
    assert json.loads(json.dumps(item)) == document


def _records(*outcomes: Outcome) -> list[AttemptRecord]:
    return [AttemptRecord(node=f"n{i}", outcome=o, elapsed=1.0) for i, o in enumerate(outcomes)]


FAILURES = [
    pytest.param([], 502, id="no-attempt"),
    pytest.param([Outcome.CONNECT_FAILED], 502, id="connect-failed"),
    pytest.param(
        [Outcome.RESET, Outcome.CLOSED_EARLY, Outcome.PROTOCOL_ERROR], 502, id="fast-errors"
    ),
    pytest.param([Outcome.RETRYABLE_RESPONSE, Outcome.TLS_ERROR], 502, id="retryable-and-tls"),
    pytest.param([Outcome.CONNECT_TIMEOUT], 504, id="connect-timeout"),
    pytest.param([Outcome.HEADER_TIMEOUT], 504, id="header-timeout"),
    pytest.param([Outcome.RESET, Outcome.FIRST_BODY_TIMEOUT], 504, id="one-timeout-among-errors"),
    pytest.param([Outcome.DEAD_PEER, Outcome.CONNECT_FAILED], 504, id="dead-peer-first"),
]


@pytest.mark.parametrize(("outcomes", "status"), FAILURES)
def test_failure_status(outcomes: list[Outcome], status: int) -> None:
    records = _records(*outcomes)
    assert failure_status(records) == status
    assert failure_status(iter(records)) == status  # any iterable


# -- the rules table and the decisions taken from the shell -------------------------------


def test_every_outcome_has_one_rules_row() -> None:
    assert set(RULES) == set(Outcome)


@pytest.mark.parametrize("outcome", list(Outcome), ids=str)
def test_a_row_s_status_follows_its_deadline_before_commit(outcome: Outcome) -> None:
    rule = RULES[outcome]
    if rule.fails_over:
        assert rule.status == (504 if rule.timed_out else 502)
    else:
        assert rule.status is None  # the proxy never answers for such an ending


RETRY_AFTERS = [
    pytest.param(429, [(b"retry-after", b"7")], 7.0, id="429-seconds"),
    pytest.param(503, [(b"retry-after", b"7")], None, id="503-ignored"),
    pytest.param(429, [], None, id="429-without"),
    pytest.param(
        429,
        [
            (b"retry-after", b"Mon, 30 Nov 2026 12:00:30 GMT"),
            (b"date", b"Mon, 30 Nov 2026 12:00:00 GMT"),
        ],
        30.0,
        id="429-date",
    ),
    pytest.param(429, [(b"retry-after", b"Mon, 30 Nov 2026 12:00:30 GMT")], None, id="date-alone"),
]


@pytest.mark.parametrize(("status", "headers", "seconds"), RETRY_AFTERS)
def test_retry_after_of(
    status: int, headers: list[tuple[bytes, bytes]], seconds: float | None
) -> None:
    assert retry_after_of(status, headers) == seconds


@pytest.mark.parametrize(
    ("outcome", "ending"),
    [
        (Outcome.DEAD_PEER, Outcome.DEAD_PEER),
        (Outcome.RESET, Outcome.STREAM_BROKEN),
        (Outcome.CLOSED_EARLY, Outcome.STREAM_BROKEN),
        (Outcome.PROTOCOL_ERROR, Outcome.STREAM_BROKEN),
    ],
)
def test_after_commit(outcome: Outcome, ending: Outcome) -> None:
    assert after_commit(outcome) is ending


@pytest.mark.parametrize(
    ("relayed", "client_gone", "pooled"),
    [(True, False, True), (True, True, False), (False, False, False), (False, True, False)],
)
def test_may_pool(relayed: bool, client_gone: bool, pooled: bool) -> None:
    assert may_pool(relayed=relayed, client_gone=client_gone) is pooled


@pytest.mark.parametrize(
    ("status", "ends"),
    [
        *[(status, True) for status in (200, 204, 304, 400, 404, 499)],
        *[(status, False) for status in (500, 501, 599)],
    ],
)
def test_ends_cooldown(status: int, ends: bool) -> None:
    assert ends_cooldown(status) is ends


@pytest.mark.parametrize(
    ("action", "code", "fails_over"),
    [
        (HeadAction.RETRY, None, True),
        (HeadAction.RETRY, "other", True),
        (HeadAction.INSPECT, "context_length_exceeded", True),
        (HeadAction.INSPECT, "other", False),
        (HeadAction.INSPECT, None, False),
    ],
)
def test_fails_over_on(action: HeadAction, code: str | None, fails_over: bool) -> None:
    assert fails_over_on(action, code, DEFAULT_CODES) is fails_over


@pytest.mark.parametrize(
    ("status", "code"), [(502, "upstream_unavailable"), (504, "upstream_timeout")]
)
def test_failure_code(status: int, code: str) -> None:
    assert failure_code(status) == code
