"""Logs: the access line, failover and cooldown warnings, JSON lines, no credentials."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from trio_failover import ClientKey, Config, Upstream
from trio_failover.core.workload import State
from trio_failover.proxy import Proxy
from trio_failover.telemetry.logs import (
    BatchedStreamHandler,
    FlushLogs,
    JSONFormatter,
    TextFormatter,
    _text,
    configure_logging,
    logger,
    redact,
)
from trio_failover.testing import (
    FakeNode,
    Fleet,
    frozen,
    headers_then_silence,
    healthy,
    request,
    retry_status,
)

# Streamed: the response-header timeout bounds the wait for its head (an
# unstreamed request would wait --unstreamed-timeout).
BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
# Neither looks like a credential to the scrubber in logs.py (no "Bearer",
# not registered as a secret), so only the proxy's care keeps them out.
CLIENT_SECRET = "client-secret-4f1c9a"
NODE_SECRET = "node-secret-77b2e0"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """Restore trio_failover's logger after a test that configures it."""
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield io.StringIO()
    logger.handlers[:], logger.level, logger.propagate = saved


def make_proxy(fleet: Fleet, **settings: object) -> Proxy:
    upstreams = [
        Upstream(name, f"http://{name}.invalid:80", headers={"X-Api-Key": NODE_SECRET})
        for name in fleet.nodes
    ]
    config = Config(upstreams=upstreams, admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


async def send_failover_traffic(proxy: Proxy) -> list[dict[str, Any]]:
    """One request that stalls on ``frozen``, fails over, and carries credentials."""
    events = []
    with proxy.events.subscribe(0) as subscription:
        response = await request(
            proxy,
            body=BODY,
            headers=[
                ("authorization", f"Key {CLIENT_SECRET}"),
                ("x-api-key", CLIENT_SECRET),
                ("x-request-id", "req-1"),
            ],
        )
        assert response is not None
        assert response.status == 200
        while True:
            try:
                events.append(subscription.receive.receive_nowait())
            except trio.WouldBlock:
                break
    return events


async def test_json_lines_carry_the_access_log_and_warnings_and_no_credentials(
    autojump_clock: trio.abc.Clock, captured: io.StringIO
) -> None:
    configure_logging("json", "debug", stream=captured)
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        events = await send_failover_traffic(proxy)
        status = proxy.status()
        # The credentials did travel: the node got both its own and the client's.
        received = fleet["good"].received[0]
        assert received.header("authorization") == f"Key {CLIENT_SECRET}".encode()
        assert NODE_SECRET.encode() in [v for k, v in received.headers if k == b"x-api-key"]

    text = captured.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    assert lines
    for line in lines:
        assert {"time", "level", "logger", "message"} <= line.keys()
        assert line["time"].endswith("Z")

    [access] = [line for line in lines if line["logger"] == "trio_failover.access"]
    assert access["level"] == "info"
    assert access["message"] == "request"
    assert access["id"] == "req-1"
    assert (access["method"], access["path"], access["status"]) == (
        "POST",
        "/v1/chat/completions",
        200,
    )
    assert access["nodes"] == ["frozen:header_timeout", "good:completed"]
    assert access["commit_ms"] == 10000.0
    assert access["duration_ms"] == 10000.0
    assert access["bytes"] == 2

    [failover] = [line for line in lines if line["message"] == "failover"]
    assert failover["level"] == "warning"
    assert (failover["id"], failover["node"], failover["outcome"]) == (
        "req-1",
        "frozen",
        "header_timeout",
    )
    [cooldown] = [line for line in lines if line["message"] == "cooldown"]
    assert cooldown["level"] == "warning"
    assert (cooldown["node"], cooldown["reason"], cooldown["for_s"]) == (
        "frozen",
        "header_timeout",
        10.0,
    )

    for where in (text, json.dumps(events), json.dumps(status)):
        assert CLIENT_SECRET not in where
        assert NODE_SECRET not in where
    assert {event["state"] for event in events if event["type"] == "workload"} >= {"completed"}


async def test_text_lines_and_the_log_level(
    autojump_clock: trio.abc.Clock, captured: io.StringIO
) -> None:
    configure_logging("text", "warning", stream=captured)
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        await send_failover_traffic(proxy)
    lines = captured.getvalue().splitlines()
    assert [line.split(" ")[1:3] for line in lines] == [
        ["WARNING", "failover"],
        ["WARNING", "cooldown"],
    ]  # the info-level access line is below the level
    assert "node=frozen" in lines[0]
    assert "outcome=header_timeout" in lines[0]
    assert "reason=header_timeout" in lines[1]
    assert CLIENT_SECRET not in captured.getvalue()


def _record(message: str, **fields: object) -> logging.LogRecord:
    record = logging.LogRecord("trio_failover", logging.INFO, __file__, 1, message, None, None)
    record.fields = fields
    return record


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Authorization: Bearer abc.DEF-123", "Authorization: Bearer ***"),
        ("basic dXNlcjpwYXNz and more", "basic *** and more"),
        ("http://user:pa55@gpu-a:8000/v1", "http://***@gpu-a:8000/v1"),
        ("http://gpu-a:8000/v1 took 3 tokens", "http://gpu-a:8000/v1 took 3 tokens"),
    ],
)
def test_redact_scrubs_what_looks_like_a_credential(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_both_formats_scrub_registered_secrets(captured: io.StringIO) -> None:
    configure_logging("json", "info", stream=captured, secrets=["sk-registered-xyz", "short"])
    record = _record('failed: "sk-registered-xyz" rejected', url="http://u:p@h/", n=1)
    document = json.loads(JSONFormatter().format(record))
    assert document["message"] == 'failed: "***" rejected'
    assert document["url"] == "http://***@h/"
    assert document["n"] == 1
    line = TextFormatter().format(record)
    assert "sk-registered-xyz" not in line
    assert "url=http://***@h/" in line
    assert redact("short") == "short"  # too short to be scrubbed safely


async def test_batched_lines_wait_for_the_loop_to_go_idle(captured: io.StringIO) -> None:
    handler = configure_logging("text", "info", stream=captured, batched=True)
    assert isinstance(handler, BatchedStreamHandler)
    instrument = FlushLogs(handler)
    trio.lowlevel.add_instrument(instrument)
    try:
        logger.info("first")
        logger.warning("second")
        assert captured.getvalue() == ""  # held: no write per line
        await trio.lowlevel.checkpoint()  # a pass of the loop, with its I/O poll
        lines = captured.getvalue().splitlines()
        assert [line.split()[1:3] for line in lines] == [["INFO", "first"], ["WARNING", "second"]]
        await trio.lowlevel.checkpoint()
        assert len(captured.getvalue().splitlines()) == 2  # nothing written twice
    finally:
        trio.lowlevel.remove_instrument(instrument)


def test_batched_lines_are_written_by_an_explicit_flush(captured: io.StringIO) -> None:
    handler = configure_logging("json", "info", stream=captured, batched=True)
    logger.info("kept")
    assert captured.getvalue() == ""
    handler.flush()
    assert json.loads(captured.getvalue())["message"] == "kept"


def _text_by_json(value: object) -> str:
    """The text format's rule for a field value, spelled with json.dumps alone."""
    if isinstance(value, str):
        return json.dumps(value) if (" " in value or not value) else value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    text = json.dumps(value, separators=(",", ":"))
    return json.dumps(text) if " " in text else text


@given(
    st.lists(st.text(max_size=12)) | st.lists(st.from_regex(r"[a-z0-9:_-]{0,12}", fullmatch=True))
)
def test_text_lists_read_as_json_writes_them(value: list[str]) -> None:
    # The attempts list takes a shortcut past json.dumps; it must not show.
    assert _text(value) == _text_by_json(value)


@pytest.mark.parametrize(
    "value",
    [["a:completed"], [], [""], ['q"x'], ["a b"], ["a\\b"], ["é"], ["\x7f"], ["a", 1], None],
)
def test_text_of_awkward_lists(value: object) -> None:
    assert _text(value) == _text_by_json(value)


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "",
        "two words",
        'q"x',
        "é",
        0,
        -7,
        1.5,
        0.1 + 0.2,
        float("inf"),
        True,
        False,
        None,
        State.COMPLETED,
        ["a:completed", "b:header_timeout"],
        [],
        ["a b"],
        ["a", 1],
        {"a": 1},
        (1, 2),
    ],
)
def test_text_format_writes_each_field_as_the_rule_says(value: object) -> None:
    # The formatter writes the common types itself, past _text: same text.
    line = TextFormatter().format(_record("request", k=value, after="x"))
    assert line.split(" ", 2)[2] == f"request k={_text_by_json(value)} after=x"


async def access_line_of(proxy: Proxy, captured: io.StringIO) -> tuple[bytes, dict[str, Any]]:
    """One request's body as the client got it, and its access line."""
    response = await request(proxy, body=BODY)
    assert response is not None
    [access] = [
        line
        for line in map(json.loads, captured.getvalue().splitlines())
        if line["logger"] == "trio_failover.access"
    ]
    return response.body, access


async def test_access_line_counts_the_proxys_own_error_body(
    autojump_clock: trio.abc.Clock, captured: io.StringIO
) -> None:
    configure_logging("json", "info", stream=captured)
    async with Fleet({"frozen": FakeNode(frozen())}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=1.0)
        body, access = await access_line_of(proxy, captured)
    assert access["status"] == 504
    assert body.startswith(b'{"error"')
    assert access["bytes"] == len(body)


async def test_access_line_counts_a_relayed_retryable_answer(
    autojump_clock: trio.abc.Clock, captured: io.StringIO
) -> None:
    configure_logging("json", "info", stream=captured)
    async with Fleet({"busy": FakeNode(retry_status(503, b'{"busy": true}'))}) as fleet:
        proxy = make_proxy(fleet)
        body, access = await access_line_of(proxy, captured)
    assert access["status"] == 503
    assert body == b'{"busy": true}'
    assert access["bytes"] == len(body)


async def test_access_line_counts_the_body_of_a_401(
    autojump_clock: trio.abc.Clock, captured: io.StringIO
) -> None:
    configure_logging("json", "info", stream=captured)
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, clients=(ClientKey("alice", "k-3b9f2c71d0e4a856"),))
        body, access = await access_line_of(proxy, captured)
    assert (access["status"], access["state"]) == (401, "unauthorized")
    assert access["bytes"] == len(body) > 0


async def test_commit_ms_counts_to_the_first_body_byte_not_the_head(
    autojump_clock: trio.abc.Clock, captured: io.StringIO
) -> None:
    # The commit waits for the first body byte, so the head at
    # t=0 and the body at t=3 make a 3 s commit, whatever the head's time.
    configure_logging("json", "info", stream=captured)
    async with Fleet({"late": FakeNode(headers_then_silence(3.0))}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 200
    [access] = [
        line
        for line in map(json.loads, captured.getvalue().splitlines())
        if line["logger"] == "trio_failover.access"
    ]
    assert access["commit_ms"] == 3000.0
    assert trio.current_time() == 3.0
