"""core/spans.py and headers.with_trace_context: what the traces say, as tables."""

from __future__ import annotations

import pytest

from trio_failover.core.headers import with_trace_context
from trio_failover.core.spans import (
    SpanEnd,
    attempt_end,
    operation_name,
    traces_url,
    workload_attributes,
    workload_end,
)


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://otel:4318", "http://otel:4318/v1/traces"),
        ("http://otel:4318/", "http://otel:4318/v1/traces"),
        ("https://otel.example/otlp", "https://otel.example/otlp/v1/traces"),
        ("http://otel:4318/v1/traces", "http://otel:4318/v1/traces"),
        ("http://otel:4318/v1/traces/", "http://otel:4318/v1/traces"),
    ],
)
def test_traces_url(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


@pytest.mark.parametrize(
    ("path", "operation"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),
        ("/v1/completions", "text_completion"),
        ("/v1/embeddings", "embeddings"),
        ("/api/chat", "chat"),
        ("/api/generate", "text_completion"),
        ("/api/embed", "embeddings"),
        ("/v1/models", None),
        ("/", None),
        ("/health", None),
    ],
)
def test_operation_name(path: str, operation: str | None) -> None:
    assert operation_name(path) == operation


def test_workload_attributes_leave_out_what_is_unknown() -> None:
    attributes = workload_attributes(
        method="GET",
        path="/metrics",
        scheme="https",
        workload_id="w",
        model=None,
        client_address=None,
        client=None,
    )
    assert attributes == {
        "http.request.method": "GET",
        "url.path": "/metrics",
        "url.scheme": "https",
        "trio_failover.workload_id": "w",
    }


@pytest.mark.parametrize(
    ("outcome", "status", "detail", "error"),
    [
        ("completed", 200, "", None),
        ("retryable_response", 503, "a: head: answered 503", "a: head: answered 503"),
        ("connect_failed", None, "", "connect_failed"),
        ("client_abort", None, "client reset", "client reset"),
        ("stream_broken", 200, "cut", "cut"),
    ],
)
def test_attempt_end(outcome: str, status: int | None, detail: str, error: str | None) -> None:
    end = attempt_end(outcome, 1.25, status, detail)
    assert end.error == error
    assert end.attributes["trio_failover.outcome"] == outcome
    assert end.attributes["trio_failover.elapsed_ms"] == 1250.0
    assert end.attributes.get("http.response.status_code") == status
    assert end.attributes.get("error.type") == (None if error is None else outcome)


# state, status, committed, last outcome -> error.type, span status description
WORKLOAD_ENDS: list[tuple[str, int | None, bool, str | None, str | None, str | None]] = [
    ("completed", 200, True, "completed", None, None),
    ("cancelled", None, False, "client_abort", "cancelled", "cancelled"),
    ("cancelled", 200, True, "client_abort", "cancelled", "cancelled"),
    ("failed", 502, False, "connect_failed", "502", "answered 502"),
    ("failed", 504, False, "header_timeout", "504", "answered 504"),
    ("failed", 503, False, None, "503", "answered 503"),  # the queue's
    ("failed", 200, True, "stream_broken", "stream_broken", "the stream was cut: stream_broken"),
    # A 4xx is the client's mistake: no error of the server's span.
    ("failed", 404, False, None, None, None),
    ("failed", 429, False, "retryable_response", None, None),
    ("failed", None, False, None, "_OTHER", "failed"),
]


@pytest.mark.parametrize(
    ("state", "status", "committed", "last", "error_type", "error"), WORKLOAD_ENDS
)
def test_workload_end(
    state: str,
    status: int | None,
    committed: bool,
    last: str | None,
    error_type: str | None,
    error: str | None,
) -> None:
    end = workload_end(
        state, status, committed=committed, last_outcome=last, node="b", attempts=2, queued=0.5
    )
    assert end.error == error
    assert end.attributes.get("error.type") == error_type
    assert end.attributes["trio_failover.outcome"] == state
    assert end.attributes["trio_failover.queued_ms"] == 500.0
    assert end.attributes.get("http.response.status_code") == status


@pytest.mark.parametrize(
    ("state", "reason"),
    [("cancelled", "client_abort"), ("cancelled", "shutdown"), ("completed", None)],
)
def test_workload_end_says_why_a_workload_was_cancelled(state: str, reason: str | None) -> None:
    end = workload_end(
        state,
        None,
        committed=False,
        last_outcome=None,
        node=None,
        attempts=1,
        queued=0.0,
        reason=reason,
    )
    assert end.attributes.get("trio_failover.reason") == reason


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(None, (None, None)), ((11, 6), (11, 6)), ((0, 0), (0, 0))],
)
def test_workload_end_carries_the_answers_tokens(
    tokens: tuple[int, int] | None, expected: tuple[int | None, int | None]
) -> None:
    end = workload_end(
        "completed",
        200,
        committed=True,
        last_outcome="completed",
        node="a",
        attempts=1,
        queued=0.0,
        tokens=tokens,
    )
    attributes = end.attributes
    found = (
        attributes.get("gen_ai.usage.input_tokens"),
        attributes.get("gen_ai.usage.output_tokens"),
    )
    assert found == expected


def test_span_end_defaults_to_no_error() -> None:
    assert SpanEnd({}).error is None


@pytest.mark.parametrize(
    ("headers", "fields", "result"),
    [
        (
            [(b"host", b"n"), (b"x-request-id", b"1")],
            {"traceparent": "00-a-b-01"},
            [(b"host", b"n"), (b"x-request-id", b"1"), (b"traceparent", b"00-a-b-01")],
        ),
        (  # the client's replaced, never doubled
            [(b"traceparent", b"00-c-d-01"), (b"tracestate", b"x=1"), (b"host", b"n")],
            {"traceparent": "00-a-b-01", "tracestate": "x=1"},
            [(b"host", b"n"), (b"traceparent", b"00-a-b-01"), (b"tracestate", b"x=1")],
        ),
        (  # a tracestate the trace no longer has goes too
            [(b"tracestate", b"x=1")],
            {"traceparent": "00-a-b-01"},
            [(b"traceparent", b"00-a-b-01")],
        ),
    ],
)
def test_with_trace_context(
    headers: list[tuple[bytes, bytes]],
    fields: dict[str, str],
    result: list[tuple[bytes, bytes]],
) -> None:
    assert with_trace_context(headers, fields) == result
