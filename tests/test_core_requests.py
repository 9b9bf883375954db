"""Table tests of request facts and of a node's request (trio_failover.core.requests)."""

from __future__ import annotations

import json
import re
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_failover.core.requests import (
    client_workload_id,
    is_list_route,
    is_ollama_path,
    is_unstreamed,
    new_workload_id,
    node_target,
    request_document,
    request_line_path,
    request_model,
    uuid4_text,
    workload_id,
)

# (path, body) -> unstreamed?
UNSTREAMED = [
    # OpenAI-style APIs answer whole unless asked to stream.
    pytest.param("/v1/chat/completions", {"model": "m"}, True, id="openai-default"),
    pytest.param("/v1/chat/completions", {"stream": False}, True, id="openai-false"),
    pytest.param("/v1/chat/completions", {"stream": True}, False, id="openai-true"),
    pytest.param("/v1/chat/completions", {"stream": None}, True, id="openai-null"),
    pytest.param("/v1/completions", {"stream": 1}, True, id="openai-one-is-not-true"),
    pytest.param("/v1/embeddings", {"input": "x"}, True, id="embeddings"),
    # Ollama's native API streams unless told not to.
    pytest.param("/api/chat", {"model": "m"}, False, id="ollama-default"),
    pytest.param("/api/generate", {"stream": False}, True, id="ollama-false"),
    pytest.param("/api/chat", {"stream": True}, False, id="ollama-true"),
    pytest.param("/api/chat", {"stream": None}, False, id="ollama-null"),
    pytest.param("/api/chat", {"stream": 0}, False, id="ollama-zero-is-not-false"),
    # No JSON object body: keep the response-header timeout.
    pytest.param("/v1/chat/completions", None, False, id="no-body"),
    pytest.param("/v1/chat/completions", [{"stream": False}], False, id="json-array"),
    pytest.param("/v1/models", "text", False, id="json-string"),
    # "/api" alone, and look-alikes, are not Ollama's native API.
    pytest.param("/api", {"model": "m"}, True, id="bare-api"),
    pytest.param("/apis/x", {"model": "m"}, True, id="look-alike"),
]


@pytest.mark.parametrize(("path", "document", "expected"), UNSTREAMED)
def test_is_unstreamed(path: str, document: object, expected: bool) -> None:
    assert is_unstreamed(path, document) is expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/api/chat", True), ("/api/", True), ("/api", False), ("/v1/api/x", False), ("/", False)],
)
def test_is_ollama_path(path: str, expected: bool) -> None:
    assert is_ollama_path(path) is expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model": "m", "stream": true}', {"model": "m", "stream": True}),
        (b'  \n{"a": 1}', {"a": 1}),
        (b"", None),
        (b"[1, 2]", None),  # not an object: not worth a parse
        (b"{not json", None),
        (b'{"a": "\xff"}', None),  # bad UTF-8
        (b"{" + b'"a":' * 1 + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # nesting
        (b"model=m&stream=true", None),
    ],
)
def test_request_document(body: bytes, expected: object) -> None:
    assert request_document(body) == expected


@pytest.mark.parametrize(
    ("document", "expected"),
    [({"model": "m"}, "m"), ({"model": 3}, None), ({}, None), (None, None), (["m"], None)],
)
def test_request_model(document: object, expected: str | None) -> None:
    assert request_model(document) == expected


CANONICAL_V4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def test_new_workload_id_is_a_canonical_version_4_uuid() -> None:
    ids = {new_workload_id() for _ in range(200)}
    assert len(ids) == 200
    for text in ids:
        assert CANONICAL_V4.fullmatch(text), text
        parsed = uuid.UUID(text)
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
        assert str(parsed) == text


@given(st.integers(min_value=0, max_value=(1 << 128) - 1))
def test_uuid4_text_is_what_the_uuid_module_makes(bits: int) -> None:
    assert uuid4_text(bits) == str(uuid.UUID(int=bits, version=4))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"abc", "abc"),
        (b"A-Z.a_z:0-9", "A-Z.a_z:0-9"),
        (b"x" * 128, "x" * 128),
        (b"x" * 129, None),
        (b"", None),
        (b"has space", None),
        (b"abc\n", None),  # fullmatch, not match-to-$
        (b"caf\xc3\xa9", None),
        (b'"quoted"', None),
        (None, None),
    ],
)
def test_client_workload_id(value: bytes | None, expected: str | None) -> None:
    assert client_workload_id(value) == expected


def test_workload_id_keeps_a_valid_client_id() -> None:
    assert workload_id([(b"x-request-id", b"req-1"), (b"x-request-id", b"req-2")]) == "req-1"


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"x-request-id", b"bad id")],
        [(b"x-request-id", b"bad id"), (b"x-request-id", b"good")],  # only the first counts
        [(b"x-other", b"good")],
    ],
)
def test_workload_id_makes_a_uuid_otherwise(headers: list[tuple[bytes, bytes]]) -> None:
    assert CANONICAL_V4.fullmatch(workload_id(headers))


def test_request_document_round_trips_a_large_body() -> None:
    document = {"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}]}
    assert request_document(json.dumps(document).encode()) == document


KEPT_IDS = [
    pytest.param("a", id="one-char"),
    pytest.param("0f3c9a2e-8d1b-4b7e-9a55-2f0d1c3b4a5e", id="uuid"),
    pytest.param("req.42_retry:1-A", id="every-punctuation"),
    pytest.param("x" * 128, id="128-chars"),
    pytest.param("ebede0e35c12c79a29d38a34", id="not-a-uuid-but-valid"),
]


@pytest.mark.parametrize("value", KEPT_IDS)
def test_workload_id_passes_a_valid_client_id_through(value: str) -> None:
    assert workload_id([(b"x-request-id", value.encode())]) == value


REPLACED_IDS = [
    pytest.param(None, id="absent"),
    pytest.param(b"", id="empty"),
    pytest.param(b"x" * 129, id="129-chars"),
    pytest.param(b"has space", id="space"),
    pytest.param(b"caf\xc3\xa9", id="non-ascii-utf8"),
    pytest.param(b"caf\xe9", id="non-ascii-latin1"),
    pytest.param(b"a/b", id="slash"),
    pytest.param(b'a"b', id="quote"),
    pytest.param(b"abc\n", id="trailing-newline"),
    pytest.param(b"\nabc", id="leading-newline"),
]


@pytest.mark.parametrize("value", REPLACED_IDS)
def test_workload_id_replaces_anything_else_with_a_uuid(value: bytes | None) -> None:
    headers = [] if value is None else [(b"x-request-id", value)]
    fresh = workload_id(headers)
    assert CANONICAL_V4.fullmatch(fresh), fresh
    assert workload_id(headers) != fresh  # random, not derived from the input
    # A fresh id is itself valid, so it survives the next hop unchanged.
    assert workload_id([(b"x-request-id", fresh.encode())]) == fresh


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"POST /api/chat HTTP/1.1\r\nHost: x\r\n\r\n", "/api/chat"),
        (b"GET /api/tags?x=1 HTTP/1.1\r\n", "/api/tags"),
        (bytearray(b"GET /v1/models HTTP/1.0\r\nX-Big: aaaa"), "/v1/models"),  # cut short
        (b"POST /api/chat HTTP/1.1\n", ""),  # a bare LF
        (b"POST  /api/chat HTTP/1.1\r\n", ""),  # two spaces
        (b"POST http://h/api/chat HTTP/1.1\r\n", ""),  # absolute-form
        (b"POST /api/chat HTTP/1.1", ""),  # the line has not ended yet
        (b"POST /api/ch\x00at HTTP/1.1\r\n", ""),
        (b"", ""),
    ],
)
def test_request_line_path(head: bytes | bytearray, expected: str) -> None:
    assert request_line_path(head) == expected


@pytest.mark.parametrize(
    ("method", "target", "expected"),
    [
        pytest.param(b"GET", b"/v1/models", True, id="models"),
        pytest.param(b"GET", b"/api/tags", True, id="tags"),
        pytest.param(b"GET", b"/v1/models?limit=5", True, id="query-ignored"),
        pytest.param(b"HEAD", b"/v1/models", False, id="head-is-a-workload"),
        pytest.param(b"POST", b"/api/tags", False, id="post-is-a-workload"),
        pytest.param(b"GET", b"/v1/models/m", False, id="one-model-is-a-workload"),
        pytest.param(b"GET", b"/api/tags/", False, id="trailing-slash"),
    ],
)
def test_is_list_route(method: bytes, target: bytes, expected: bool) -> None:
    assert is_list_route(method, target) is expected


@pytest.mark.parametrize(
    ("target", "base_path", "expected"),
    [
        pytest.param(b"/v1/chat?x=1", "", b"/v1/chat?x=1", id="origin-form"),
        pytest.param(b"/v1/chat", "/ollama", b"/ollama/v1/chat", id="base-path"),
        pytest.param(b"http://proxy:8080/v1/chat?x=1", "", b"/v1/chat?x=1", id="absolute-form"),
        pytest.param(b"http://proxy:8080", "/b", b"/b/", id="absolute-form-no-path"),
    ],
)
def test_node_target(target: bytes, base_path: str, expected: bytes) -> None:
    assert node_target(target, base_path) == expected
