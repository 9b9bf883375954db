"""Table tests of the proxy's own error answers (trio_failover.core.answers)."""

from __future__ import annotations

import pytest

from trio_failover.core.answers import error_document, error_headers, error_type

ATTEMPTS = [{"node": "a", "outcome": "header_timeout", "elapsed_ms": 120000.0}]

# (path, status, code, attempts) -> document
DOCUMENTS = [
    pytest.param(
        "/v1/chat/completions",
        504,
        "upstream_timeout",
        ATTEMPTS,
        {
            "error": {
                "message": "m",
                "type": "upstream_error",
                "code": "upstream_timeout",
            },
            "attempts": ATTEMPTS,
        },
        id="openai-504-with-attempts",
    ),
    pytest.param(
        "/v1/chat/completions",
        404,
        "model_not_found",
        [],
        {
            "error": {
                "message": "m",
                "type": "invalid_request_error",
                "code": "model_not_found",
            },
            "attempts": [],
        },
        id="openai-404-empty-attempts",
    ),
    pytest.param(
        "/v1/models",
        413,
        "request_too_large",
        None,
        {"error": {"message": "m", "type": "invalid_request_error", "code": "request_too_large"}},
        id="openai-413-no-attempts",
    ),
    pytest.param(
        "/v1/x",
        401,
        "invalid_api_key",
        None,
        {"error": {"message": "m", "type": "invalid_request_error", "code": "invalid_api_key"}},
        id="openai-401",
    ),
    pytest.param(
        "/v1/x",
        503,
        "queue_full",
        None,
        {"error": {"message": "m", "type": "upstream_error", "code": "queue_full"}},
        id="openai-503",
    ),
    pytest.param(
        "/api/chat",
        502,
        "upstream_unavailable",
        ATTEMPTS,
        {"error": "m", "code": "upstream_unavailable", "attempts": ATTEMPTS},
        id="ollama-502-attempts-top-level",
    ),
    pytest.param(
        "/api/generate",
        400,
        "bad_request",
        None,
        {"error": "m", "code": "bad_request"},
        id="ollama-400",
    ),
    pytest.param(
        "/api/tags?x=1",
        404,
        "model_not_found",
        [],
        {"error": "m", "code": "model_not_found", "attempts": []},
        id="ollama-query-ignored",
    ),
    pytest.param(
        "/api",
        431,
        "headers_too_large",
        None,
        {"error": {"message": "m", "type": "invalid_request_error", "code": "headers_too_large"}},
        id="bare-api-is-openai",
    ),
]


@pytest.mark.parametrize(("path", "status", "code", "attempts", "expected"), DOCUMENTS)
def test_error_document(
    path: str,
    status: int,
    code: str,
    attempts: list[dict[str, object]] | None,
    expected: dict[str, object],
) -> None:
    assert error_document(path, status, code, "m", attempts) == expected


@pytest.mark.parametrize("path", ["/status", "/api/chat"])
def test_admin_errors_are_openai_shaped_admin_errors(path: str) -> None:
    assert error_document(path, 401, "unauthorized", "m", admin=True) == {
        "error": {"message": "m", "type": "admin_error", "code": "unauthorized"}
    }


@pytest.mark.parametrize(
    ("status", "admin", "expected"),
    [
        (400, False, "invalid_request_error"),
        (499, False, "invalid_request_error"),
        (500, False, "upstream_error"),
        (504, False, "upstream_error"),
        (404, True, "admin_error"),
        (503, True, "admin_error"),
    ],
)
def test_error_type(status: int, admin: bool, expected: str) -> None:
    assert error_type(status, admin=admin) == expected


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("invalid_api_key", [(b"www-authenticate", b"Bearer")]),
        ("invalid_admin_token", [(b"www-authenticate", b"Bearer")]),
        ("queue_full", [(b"retry-after", b"1")]),
        ("queue_timeout", [(b"retry-after", b"1")]),
        ("shutting_down", [(b"retry-after", b"1")]),
        ("upstream_timeout", []),
        ("model_not_found", []),
    ],
)
def test_error_headers(code: str, expected: list[tuple[bytes, bytes]]) -> None:
    assert error_headers(code) == expected


def test_error_headers_are_fresh_lists() -> None:
    error_headers("queue_full").append((b"x", b"y"))
    assert error_headers("queue_full") == [(b"retry-after", b"1")]


def test_documents_do_not_share_the_callers_list() -> None:
    attempts: list[dict[str, object]] = []
    document = error_document("/api/chat", 502, "c", "m", attempts)
    attempts.append({"node": "late"})
    assert document["attempts"] == []
