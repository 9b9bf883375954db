"""Client keys and the admin token appear nowhere the proxy writes.

One run with keys and a token configured sends what could leak them:
right keys in both headers, wrong keys, a right key in the wrong scheme, a
malformed request carrying a key, failovers (warning lines), admin calls
with the token as a header and in the query, a wrong token, and an
``/events`` WebSocket subscribed for the whole run. Then every log record
(raw, before any formatter could scrub it, and as the text and JSON
formats print it), every event, every ``/status`` and ``/metrics`` answer,
every answer to a client and ``trio-failover check`` are searched for each
secret.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from auth_fleet import (
    ALICE_KEY,
    BOB_KEY,
    CLIENTS,
    LIMIT,
    MODEL,
    TOKEN,
    WRONG_KEY,
    chat_body,
    running,
)
from leaks import PrintedLogs, closed_port
from support import serve_process
from typer.testing import CliRunner

from trio_failover import Upstream
from trio_failover.cli.cli import app
from trio_failover.testing import ClientResponse, FakeNode, Fleet, openai, request_tcp

SECRETS = {"alice's key": ALICE_KEY, "bob's key": BOB_KEY, "a wrong key": WRONG_KEY, "token": TOKEN}


# (path, streamed, headers, admitted)
CLIENT_TRAFFIC: list[tuple[str, bool, list[tuple[str, str]], bool]] = [
    ("/v1/chat/completions", True, [("Authorization", f"Bearer {ALICE_KEY}")], True),
    ("/v1/chat/completions", False, [("X-Api-Key", BOB_KEY)], True),
    ("/api/chat", True, [("X-Api-Key", ALICE_KEY)], True),
    ("/api/chat", False, [("Authorization", f"Bearer {BOB_KEY}")], True),
    ("/v1/chat/completions", True, [("Authorization", f"Bearer {WRONG_KEY}")], False),
    ("/api/chat", False, [("X-Api-Key", WRONG_KEY)], False),
    ("/v1/chat/completions", False, [("Authorization", f"Basic {ALICE_KEY}")], False),
    ("/v1/models", False, [("X-Api-Key", f"{WRONG_KEY} {TOKEN}")], False),
]


async def malformed_with_a_key(address: tuple[str, int]) -> bytes:
    """A request h11 refuses (space before the colon), carrying a right key."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(
            b"GET /v1/models HTTP/1.1\r\nHost: proxy.test\r\n"
            b"X-Api-Key : " + ALICE_KEY.encode() + b"\r\n\r\n"
        )
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    return answer


async def test_keys_and_token_appear_in_no_log_event_or_answer(
    printed_logs: PrintedLogs,
) -> None:
    raw = printed_logs.raw
    down = Upstream("down", f"http://127.0.0.1:{closed_port()}")
    answers: list[ClientResponse] = []
    admin: dict[str, httpx.Response] = {}
    pushed: list[dict[str, Any]] = []
    admitted = sum(1 for *_, ok in CLIENT_TRAFFIC if ok)
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS, admin_token=TOKEN, before=[down]) as proxy:
            events_url = proxy.admin_url.replace("http://", "ws://") + f"/events?token={TOKEN}"
            async with trio_websocket.open_websocket_url(events_url) as ws:
                for path, stream, headers, _ in CLIENT_TRAFFIC:
                    response = await request_tcp(
                        proxy.bound.client,
                        "POST",
                        path,
                        body=chat_body(path, stream),
                        headers=headers,
                    )
                    assert response is not None
                    answers.append(response)
                malformed = await malformed_with_a_key(proxy.bound.client)
                while sum(e.get("state") == "completed" for e in pushed) < admitted:
                    pushed.append(json.loads(await ws.get_message()))
            bearer = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=proxy.admin_url, trust_env=False) as http:
                admin["/status"] = await http.get("/status", headers=bearer)
                admin["/metrics"] = await http.get(f"/metrics?token={TOKEN}")
                admin["/"] = await http.get(f"/?token={TOKEN}")
                admin["/status wrong"] = await http.get(f"/status?token={WRONG_KEY}")
                admin["/metrics none"] = await http.get("/metrics")
            published = await proxy.finished(admitted)

    check = CliRunner().invoke(
        app,
        ["check", "--upstream", "n=http://127.0.0.1:9", "--api-key", f"alice={ALICE_KEY}"],
        env={"TRIO_FAILOVER_API_KEYS": f"bob={BOB_KEY}", "TRIO_FAILOVER_ADMIN_TOKEN": TOKEN},
    )

    # The run did what it should: the secrets had their chances to leak.
    assert [r.status for r in answers] == [200, 200, 200, 200, 401, 401, 401, 401]
    assert malformed.startswith(b"HTTP/1.1 400 ")
    assert {w["client"] for w in admin["/status"].json()["workloads"]} == {"alice", "bob"}
    assert [admin[p].status_code for p in ("/metrics", "/", "/status wrong", "/metrics none")] == [
        200,
        200,
        401,
        401,
    ]
    assert any(line.startswith("failover ") for line in raw.lines)
    assert sum(line.startswith("request ") for line in raw.lines) == len(CLIENT_TRAFFIC)
    assert check.exit_code == 0, check.output
    assert "***" in check.output

    places = {
        "log records": "\n".join(raw.lines),
        "text logs": printed_logs.text.getvalue(),
        "json logs": printed_logs.json.getvalue(),
        "events (WebSocket)": json.dumps(pushed),
        "events (bus)": json.dumps(published),
        "client answers": repr([(r.headers, r.body) for r in answers]) + repr(malformed),
        "check": check.output,
        **{f"admin {path}": repr(r.headers.raw) + r.text for path, r in admin.items()},
    }
    assert all(places.values())
    leaks = [
        (what, place)
        for what, secret in SECRETS.items()
        for place, text in places.items()
        if secret in text
    ]
    assert leaks == []


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_serve_logs_no_key_or_token(log_format: str) -> None:
    """The real command: every stderr line of a run with keys and a token."""
    with trio.fail_after(LIMIT):
        async with Fleet({"n": FakeNode(openai(MODEL))}) as fleet:
            node = await fleet.serve_tcp("n")
            async with serve_process(
                f"--upstream=n={node.url}",
                f"--api-key=alice={ALICE_KEY}",
                f"--api-key={BOB_KEY}",
                f"--admin-token={TOKEN}",
                f"--log-format={log_format}",
                "--log-level=debug",
            ) as proxy:
                for key in (ALICE_KEY, BOB_KEY, WRONG_KEY):
                    response = await request_tcp(
                        proxy.address, body=b"{}", headers=[("Authorization", f"Bearer {key}")]
                    )
                    assert response is not None
                # The lines of the three requests, the refused one last.
                await proxy.lines.wait_for("unauthorized")
                lines = list(proxy.lines)

    access = [line for line in lines if "request" in line and "/v1/chat/completions" in line]
    assert len(access) == 3
    assert any("alice" in line for line in access)
    assert any("key-2" in line for line in access)
    assert [
        (what, line) for what, secret in SECRETS.items() for line in lines if secret in line
    ] == []
