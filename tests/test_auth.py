"""Client API keys and the admin token, over real sockets.

With keys configured, every request on the client listener needs one
(``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``): without, ``401``
``invalid_api_key``, nothing sent to a node, the connection kept. The
client's credentials never travel on to a node while keys are configured.
The admin listener needs the token on every path but ``/healthz``, the
``/events`` WebSocket included. The pure checks are tests/test_core_auth.py's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing
import trio_websocket
from auth_fleet import (
    ALICE_KEY,
    BOB_KEY,
    CLIENTS,
    LIMIT,
    TOKEN,
    WRONG_KEY,
    chat_body,
    running,
)
from conftest import LogRecords
from prometheus_client.parser import text_string_to_metric_families

from trio_failover import ClientKey, Config, Upstream
from trio_failover.service.server import is_loopback, serve
from trio_failover.testing import (
    ReceivedRequest,
    read_response,
    request_tcp,
)
from trio_failover.wire.client import ClientConnection
from trio_failover.wire.http1 import send_events


def credential_names(received: ReceivedRequest) -> list[bytes]:
    return [name for name, _ in received.headers if name in (b"authorization", b"x-api-key")]


# --- the client listener --------------------------------------------------------------------

REFUSED = [
    pytest.param((), id="no-key"),
    pytest.param((("Authorization", f"Bearer {WRONG_KEY}"),), id="wrong-bearer"),
    pytest.param((("X-Api-Key", WRONG_KEY),), id="wrong-x-api-key"),
    pytest.param((("Authorization", f"Basic {ALICE_KEY}"),), id="right-key-wrong-scheme"),
    pytest.param((("Authorization", ALICE_KEY),), id="right-key-no-scheme"),
    pytest.param((("X-Api-Key", ""),), id="empty-x-api-key"),
]
ADMITTED = [
    pytest.param((("Authorization", f"Bearer {ALICE_KEY}"),), "alice", id="bearer"),
    pytest.param((("authorization", f"bearer  {ALICE_KEY}"),), "alice", id="bearer-lowercase"),
    pytest.param((("X-Api-Key", BOB_KEY),), "bob", id="x-api-key"),
    pytest.param(
        (("Authorization", f"Bearer {WRONG_KEY}"), ("X-Api-Key", BOB_KEY)),
        "bob",
        id="one-right-among-wrong",
    ),
]
PATHS = [
    pytest.param("/v1/chat/completions", id="openai"),
    pytest.param("/api/chat", id="ollama"),
]
STREAMS = [pytest.param(True, id="streamed"), pytest.param(False, id="unstreamed")]


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("headers", REFUSED)
async def test_a_request_without_a_valid_key_gets_401_and_costs_the_node_nothing(
    path: str, stream: bool, headers: Sequence[tuple[str, str]]
) -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS) as proxy:
            response = await request_tcp(
                proxy.bound.client, "POST", path, body=chat_body(path, stream), headers=headers
            )
            received = list(proxy.node.received)

    assert response is not None
    assert response.status == 401
    assert response.header("www-authenticate") == "Bearer"
    assert response.header("content-type") == "application/json"
    document = response.json()
    if path.startswith("/api/"):  # Ollama's shape: its clients show "error" as the message
        assert document == {"error": "missing or invalid API key", "code": "invalid_api_key"}
    else:
        assert document["error"]["code"] == "invalid_api_key"
        assert document["error"]["type"] == "invalid_request_error"
    assert received == []
    assert ALICE_KEY.encode() not in response.body
    assert WRONG_KEY.encode() not in response.body


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("headers", "name"), ADMITTED)
async def test_a_request_with_a_valid_key_is_served_without_its_credentials(
    path: str, stream: bool, headers: Sequence[tuple[str, str]], name: str
) -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS) as proxy:
            response = await request_tcp(
                proxy.bound.client, "POST", path, body=chat_body(path, stream), headers=headers
            )
            await proxy.finished()
            status = proxy.proxy.status()

    assert response is not None
    assert response.status == 200
    if stream:
        expected = "application/x-ndjson" if path.startswith("/api/") else "text/event-stream"
        assert response.header("content-type") == expected
        assert len(response.chunks) > 1
    else:
        assert response.header("content-type") == "application/json"
    [received] = proxy.node.received
    assert credential_names(received) == []
    assert [work["client"] for work in status["workloads"]] == [name]


# One key is the common deployment (a single --api-key); every test above
# configures two. A check that ran only from two keys on would pass them all.
ONE_KEY = (ClientKey("alice", ALICE_KEY),)
REFUSED_WITH_ONE_KEY = [
    *REFUSED,
    pytest.param((("Authorization", f"Bearer {BOB_KEY}"),), id="a-key-of-another-deployment"),
]
ADMITTED_WITH_ONE_KEY = [
    pytest.param((("Authorization", f"Bearer {ALICE_KEY}"),), id="bearer"),
    pytest.param((("X-Api-Key", ALICE_KEY),), id="x-api-key"),
]


@pytest.mark.parametrize("headers", REFUSED_WITH_ONE_KEY)
async def test_with_exactly_one_key_a_request_without_it_gets_401(
    headers: Sequence[tuple[str, str]],
) -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=ONE_KEY) as proxy:
            response = await request_tcp(proxy.bound.client, body=b"{}", headers=headers)
            received = list(proxy.node.received)

    assert response is not None
    assert response.status == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.header("www-authenticate") == "Bearer"
    assert received == []


@pytest.mark.parametrize("headers", ADMITTED_WITH_ONE_KEY)
async def test_with_exactly_one_key_a_request_with_it_is_served_without_it(
    headers: Sequence[tuple[str, str]],
) -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=ONE_KEY) as proxy:
            response = await request_tcp(proxy.bound.client, body=b"{}", headers=headers)
            await proxy.finished()
            status = proxy.proxy.status()

    assert response is not None
    assert response.status == 200
    [received] = proxy.node.received
    assert credential_names(received) == []
    assert [work["client"] for work in status["workloads"]] == ["alice"]


async def test_credentials_pass_through_when_no_key_is_configured() -> None:
    # Engines with their own --api-key rely on the client's header.
    sent = [("Authorization", f"Bearer {ALICE_KEY}"), ("X-Api-Key", BOB_KEY)]
    with trio.fail_after(LIMIT):
        async with running() as proxy:
            response = await request_tcp(proxy.bound.client, body=b"{}", headers=sent)
            await proxy.finished()
            status = proxy.proxy.status()

    assert response is not None
    assert response.status == 200
    [received] = proxy.node.received
    assert received.header("authorization") == f"Bearer {ALICE_KEY}".encode()
    assert received.header("x-api-key") == BOB_KEY.encode()
    assert [work["client"] for work in status["workloads"]] == ["anonymous"]


async def test_a_nodes_own_headers_still_apply_while_keys_are_configured() -> None:
    node_key = "sk-node-6a1f0e9d3c"
    with trio.fail_after(LIMIT):
        async with running(
            clients=CLIENTS, node_headers={"Authorization": f"Bearer {node_key}"}
        ) as proxy:
            response = await request_tcp(
                proxy.bound.client, body=b"{}", headers=[("X-Api-Key", ALICE_KEY)]
            )

    assert response is not None
    assert response.status == 200
    [received] = proxy.node.received
    assert [(n, v) for n, v in received.headers if n in (b"authorization", b"x-api-key")] == [
        (b"authorization", f"Bearer {node_key}".encode())
    ]


async def exchange(
    stream: trio.abc.Stream, conn: h11.Connection, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes]:
    """One request and its answer on an open keep-alive connection."""
    body = chat_body("/v1/chat/completions", False)
    head = [(b"host", b"proxy.test"), (b"content-length", b"%d" % len(body)), *headers]
    await send_events(
        stream,
        conn,
        h11.Request(method="POST", target="/v1/chat/completions", headers=head),
        h11.Data(data=body),
        h11.EndOfMessage(),
    )
    response = await read_response(stream, conn)
    assert response.complete
    conn.start_next_cycle()
    return response.status, response.body


async def test_the_connection_is_kept_after_a_401() -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS) as proxy:
            stream = await trio.open_tcp_stream(*proxy.bound.client)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                refused = await exchange(stream, conn, [(b"x-api-key", WRONG_KEY.encode())])
                again = await exchange(stream, conn, [])
                served = await exchange(stream, conn, [(b"x-api-key", ALICE_KEY.encode())])

    assert refused[0] == again[0] == 401
    assert served[0] == 200
    assert json.loads(served[1])["object"] == "chat.completion"
    assert len(proxy.node.received) == 1


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


async def test_the_keys_name_is_the_workloads_client_everywhere(logged: LogRecords) -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS) as proxy:
            for key in (ALICE_KEY, ALICE_KEY, BOB_KEY, WRONG_KEY):
                await request_tcp(
                    proxy.bound.client,
                    body=chat_body("/v1/chat/completions", True),
                    headers=[("Authorization", f"Bearer {key}"), ("X-Request-Id", key[:2])],
                )
            published = await proxy.finished(3)
            status = proxy.proxy.status()
            async with httpx.AsyncClient(trust_env=False) as http:
                scrape = (await http.get(proxy.admin_url + "/metrics")).text

    assert [(w["id"], w["client"]) for w in status["workloads"]] == [
        ("ka", "alice"),
        ("ka", "alice"),
        ("kb", "bob"),
    ]
    workload_events = [event for event in published if event["type"] == "workload"]
    assert workload_events
    assert {(event["id"], event["client"]) for event in workload_events} == {
        ("ka", "alice"),
        ("kb", "bob"),
    }
    access = [r for r in logged.records if r.name == "trio_failover.access"]
    assert [(r.fields["client"], r.fields["status"]) for r in access] == [  # type: ignore[attr-defined]
        ("alice", 200),
        ("alice", 200),
        ("bob", 200),
        (None, 401),
    ]
    completed = "trio_failover_workloads_total"
    assert metric(scrape, completed, state="completed", client="alice") == 2
    assert metric(scrape, completed, state="completed", client="bob") == 1
    assert metric(scrape, "trio_failover_unauthorized_total", listener="client") == 1


async def test_without_keys_the_client_is_anonymous_in_status_and_metrics() -> None:
    with trio.fail_after(LIMIT):
        async with running() as proxy:
            await request_tcp(proxy.bound.client, body=b"{}")
            await proxy.finished()
            status = proxy.proxy.status()
            async with httpx.AsyncClient(trust_env=False) as http:
                scrape = (await http.get(proxy.admin_url + "/metrics")).text

    assert [work["client"] for work in status["workloads"]] == ["anonymous"]
    name = "trio_failover_workloads_total"
    assert metric(scrape, name, state="completed", client="anonymous") == 1


# --- the admin listener ---------------------------------------------------------------------

ADMIN_ROUTES = [
    pytest.param("/status", 200, id="status"),
    pytest.param("/metrics", 200, id="metrics"),
    pytest.param("/", 200, id="dashboard"),
    pytest.param("/events", 426, id="events-without-upgrade"),
    pytest.param("/no-such-route", 404, id="unknown"),
]


@pytest.mark.parametrize(("route", "authorized_status"), ADMIN_ROUTES)
async def test_admin_routes_need_the_token(route: str, authorized_status: int) -> None:
    asks: dict[str, tuple[str, dict[str, str]]] = {
        "none": (route, {}),
        "wrong bearer": (route, {"Authorization": f"Bearer {WRONG_KEY}"}),
        "wrong query": (route + f"?token={WRONG_KEY}", {}),
        "token as x-api-key": (route, {"X-Api-Key": TOKEN}),
        "a client key": (route, {"Authorization": f"Bearer {ALICE_KEY}"}),
        "bearer": (route, {"Authorization": f"Bearer {TOKEN}"}),
        "query": (route + f"?token={TOKEN}", {}),
        "query among others": (route + f"?a=1&token={TOKEN}&b=2", {}),
    }
    answers: dict[str, httpx.Response] = {}
    with trio.fail_after(LIMIT):
        async with (
            running(clients=CLIENTS, admin_token=TOKEN) as proxy,
            httpx.AsyncClient(base_url=proxy.admin_url, trust_env=False) as http,
        ):
            for name, (target, headers) in asks.items():
                answers[name] = await http.get(target, headers=headers)

    statuses = {name: answer.status_code for name, answer in answers.items()}
    assert statuses == {
        "none": 401,
        "wrong bearer": 401,
        "wrong query": 401,
        "token as x-api-key": 401,
        "a client key": 401,
        "bearer": authorized_status,
        "query": authorized_status,
        "query among others": authorized_status,
    }
    refused = answers["none"]
    assert refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "invalid_admin_token"
    assert TOKEN not in refused.text


async def test_healthz_is_open_and_without_a_token_every_route_is() -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS, admin_token=TOKEN) as guarded:
            url = guarded.admin_url
            async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
                healthz = await http.get("/healthz")
                head = await http.head("/healthz")
        async with running(clients=CLIENTS) as open_admin:
            url = open_admin.admin_url
            async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
                status = await http.get("/status")

    assert (healthz.status_code, healthz.text) == (200, "ok")
    assert head.status_code == 200
    assert status.status_code == 200


UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
}


async def first_workload_event(ws: trio_websocket.WebSocketConnection) -> dict[str, Any]:
    while True:
        event: dict[str, Any] = json.loads(await ws.get_message())
        if event["type"] == "workload":
            return event


@pytest.mark.parametrize(
    ("query", "headers"),
    [
        pytest.param(f"?token={TOKEN}", [], id="query"),
        pytest.param("", [(b"authorization", f"Bearer {TOKEN}".encode())], id="bearer"),
    ],
)
async def test_the_events_websocket_needs_the_token(
    query: str, headers: list[tuple[bytes, bytes]]
) -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS, admin_token=TOKEN) as proxy:
            url = proxy.admin_url.replace("http://", "ws://") + "/events"
            refusals = []
            # The handshake as a browser sends it, with a wrong or no token.
            # (httpx, not trio-websocket: its client leaks the socket of a
            # refused handshake.)
            async with httpx.AsyncClient(base_url=proxy.admin_url, trust_env=False) as http:
                for bad_query, bad_headers in (
                    ("", {}),
                    (f"?token={WRONG_KEY}", {}),
                    ("", {"Authorization": f"Bearer {WRONG_KEY}"}),
                ):
                    answer = await http.get("/events" + bad_query, headers=UPGRADE | bad_headers)
                    refusals.append(answer.status_code)
            subscribers = proxy.proxy.events.subscriber_count  # the test's own only

            async with trio_websocket.open_websocket_url(url + query, extra_headers=headers) as ws:
                await request_tcp(
                    proxy.bound.client, body=b"{}", headers=[("X-Api-Key", ALICE_KEY)]
                )
                event = await first_workload_event(ws)

    assert refusals == [401, 401, 401]
    assert subscribers == 1  # a refused upgrade never subscribed
    assert event["client"] == "alice"


# --- the warning at startup -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("fe80::1%eth0", False),
        ("localhost", False),  # a name: the bound address is what is checked
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


EXPOSED = "the client listener is not on a loopback address and no API key is set"


@pytest.mark.parametrize(
    ("listen", "clients", "warned"),
    [
        pytest.param("0.0.0.0:0", (), True, id="any-address-no-key"),
        pytest.param("0.0.0.0:0", CLIENTS, False, id="any-address-keys"),
        pytest.param("127.0.0.1:0", (), False, id="loopback-no-key"),
    ],
)
async def test_serve_warns_when_exposed_without_a_key(
    logged: LogRecords, listen: str, clients: tuple[ClientKey, ...], warned: bool
) -> None:
    # Bound for a moment and closed again; no traffic leaves 127.0.0.1.
    node = Upstream("n", "http://127.0.0.1:9")
    config = Config(upstreams=[node], listen=listen, admin_listen=None, clients=clients)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, config)
            nursery.cancel_scope.cancel()

    warnings = [m for m in logged.messages(logging.WARNING) if m.startswith(EXPOSED)]
    assert len(warnings) == (1 if warned else 0)


# --- a refused request's body ---------------------------------------------------------------


async def raw_answer(address: tuple[str, int], data: bytes) -> bytes:
    """Send ``data`` (which asks to close), return everything that comes back."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(data)
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(("key", "first"), [(WRONG_KEY, b"401"), (ALICE_KEY, b"100")])
async def test_a_refused_request_is_not_invited_to_send_its_body(key: str, first: bytes) -> None:
    body = chat_body("/v1/chat/completions", False)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy.test\r\nConnection: close\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\nX-Api-Key: %s\r\n\r\n"
    ) % (len(body), key.encode())
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS) as proxy:
            # The body follows at once, as clients do that stop waiting for
            # "100 Continue": the key decides whether it is invited.
            answer = await raw_answer(proxy.bound.client, head + body)

    assert answer.startswith(b"HTTP/1.1 " + first + b" ")
    assert (b"HTTP/1.1 200 " in answer) is (key == ALICE_KEY)


async def test_a_refused_request_has_its_body_dropped_not_buffered(
    autojump_clock: trio.abc.Clock,
) -> None:
    client_side, server_side = trio.testing.memory_stream_pair()
    seen: list[list[tuple[bytes, bytes]]] = []

    def refuse(headers: list[tuple[bytes, bytes]]) -> bool:
        seen.append(headers)
        return False

    connection = ClientConnection(
        server_side, max_head=16384, max_body=1 << 20, client_header_timeout=30, admit=refuse
    )
    body = b"x" * 100_000
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection.run_reader)
        await client_side.send_all(
            b"POST /v1/x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        request = await connection.read_request()
        nursery.cancel_scope.cancel()

    assert request is not None
    assert (request.refused, request.body) == (True, b"")
    assert len(seen) == 1
    assert connection.conn.their_state is h11.DONE  # read to its end: the connection goes on
