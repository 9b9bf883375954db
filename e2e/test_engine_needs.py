"""Scenario 5: what real engines need from the proxy (issue 19)."""

from __future__ import annotations

import time

import pytest
from conftest import Fleet
from harness import Exchange, chat_body, http_get
from report import Report

CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S = 3.0


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
def test_request_without_client_id_is_served(fleet: Fleet, kind: str) -> None:
    engine = fleet.engine(kind)
    proxy = fleet.proxy([("a", engine.url)])
    # llama-cpp-python answers 400 to any X-Request-Id that is not a UUID.
    answer = Exchange.post(proxy.port, CHAT, chat_body(4, endless=False), rid=None).read_all()
    assert answer.status == 200, answer.body_bytes[:300]
    assert answer.response_headers["x-request-id"]
    status, _, body = http_get(proxy.port, "/v1/models")
    assert status == 200, body[:300]


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
def test_unstreamed_answer_longer_than_header_deadline(
    fleet: Fleet, report: Report, kind: str
) -> None:
    a, b = fleet.engines(kind, "a", "b")
    proxy = fleet.proxy(
        [("a", a.url), ("b", b.url)], "--response-header-timeout", f"{HEADER_TIMEOUT_S:g}s"
    )
    started = time.monotonic()
    answer = Exchange.post(proxy.port, CHAT, chat_body(120, stream=False), timeout=90).read_all()
    took = time.monotonic() - started
    assert answer.status == 200, answer.body_bytes[:300]
    assert answer.response_headers["x-failover-node"] == "a"
    assert answer.response_headers["x-failover-attempts"] == "1"
    assert answer.json()["usage"]["completion_tokens"] == 120
    assert took > HEADER_TIMEOUT_S, "the answer came too fast to test the deadline"
    report.record(
        "5 unstreamed answer, header deadline 3 s", kind, answered_after=round(took * 1000)
    )
