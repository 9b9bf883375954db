"""The admin listener reads requests as the client listener does: bad ones get the same answers.

Both listeners run ``wire.client.ClientConnection`` (one reader task, the
head screen, the size limits and deadlines). Each case sends the same raw
bytes to an admin connection and to a client connection with the admin's
limits (``ADMIN_MAX_HEAD``, ``ADMIN_HEAD_TIMEOUT``) and compares the
answers: status, error code and message; only the error's ``type`` says
which listener answered (``admin_error``). In memory, under ``MockClock``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.service.admin import (
    ADMIN_HEAD_TIMEOUT,
    ADMIN_MAX_HEAD,
    serve_admin_connection,
)
from trio_failover.testing import FakeNode, Fleet, healthy
from trio_failover.wire.client import ClientConnection, ClientRequest

Serve = Callable[[trio.abc.Stream], Awaitable[None]]

CASES = {
    "malformed header line": b"GET /status HTTP/1.1\r\nhost: a\r\nbad header\r\n\r\n",
    "head too large": (
        b"GET /status HTTP/1.1\r\nhost: a\r\nx-big: " + b"a" * ADMIN_MAX_HEAD + b"\r\n\r\n"
    ),
    "head too large, still coming": b"GET /status HTTP/1.1\r\nx-big: " + b"a" * ADMIN_MAX_HEAD,
    "obs-fold": b"GET /status HTTP/1.1\r\nhost: a\r\nx-a: 1\r\n 2\r\n\r\n",
    "bare LF in a header": b"GET /status HTTP/1.1\r\nhost: a\r\nx-a: 1\nx-b: 2\r\n\r\n",
    "head that never ends": b"GET /status HTTP/1.1\r\nhost: a\r\n",
    "body too large": (
        b"POST /status HTTP/1.1\r\nhost: a\r\ncontent-length: %d\r\n\r\n" % (ADMIN_MAX_HEAD + 1)
    ),
}


async def exchange(serve: Serve, data: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``data``, read the answer to its end: its status and JSON body."""
    client, server = trio.testing.memory_stream_pair()
    answer = b""
    with trio.fail_after(ADMIN_HEAD_TIMEOUT * 4):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, server)
            await client.send_all(data)
            while chunk := await client.receive_some(65536):
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    document: dict[str, Any] = json.loads(body)
    return status, document


@pytest.mark.parametrize("data", list(CASES.values()), ids=list(CASES))
async def test_a_bad_admin_request_gets_the_client_listeners_answer(
    autojump_clock: trio.abc.Clock, data: bytes
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        config = Config(
            upstreams=fleet.upstreams(),
            admin_listen=None,
            max_request_head=ADMIN_MAX_HEAD,
            max_request_body=ADMIN_MAX_HEAD,
            client_header_timeout=ADMIN_HEAD_TIMEOUT,
            discovery_interval=0,  # the node sees nothing but what the test sends
        )
        proxy = Proxy(config, connector=fleet.connector)

        async def serve_admin(stream: trio.abc.Stream) -> None:
            await serve_admin_connection(proxy, stream)

        async with proxy:
            admin_status, admin = await exchange(serve_admin, data)
            client_status, client = await exchange(proxy.handle_connection, data)
    assert admin_status == client_status
    assert admin_status in (400, 408, 413, 431)
    assert admin["error"]["type"] == "admin_error"
    assert client["error"]["type"] == "invalid_request_error"
    assert {**admin["error"], "type": None} == {**client["error"], "type": None}
    assert fleet["a"].received == []  # the client listener forwarded none of them


async def test_the_admin_listener_refuses_431_and_400_with_json(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )

        async def serve_admin(stream: trio.abc.Stream) -> None:
            await serve_admin_connection(proxy, stream)

        too_large = await exchange(serve_admin, CASES["head too large"])
        malformed = await exchange(serve_admin, CASES["malformed header line"])
    assert too_large == (
        431,
        {
            "error": {
                "message": "request header fields too large",
                "type": "admin_error",
                "code": "headers_too_large",
            }
        },
    )
    assert malformed == (
        400,
        {"error": {"message": "malformed request", "type": "admin_error", "code": "bad_request"}},
    )


async def test_a_taken_over_connection_reads_the_replay_then_every_later_byte(
    autojump_clock: trio.abc.Clock,
) -> None:
    # What /events hands trio-websocket: the upgrade request again, the
    # bytes h11 held beyond it, what the reader holds and what comes later.
    client, server = trio.testing.memory_stream_pair()
    connection = ClientConnection(server, max_head=1024, max_body=1024, client_header_timeout=10)
    read: list[bytes] = []

    async def take_over(conn: ClientConnection, request: ClientRequest) -> bool:
        stream = conn.take_over(b"REPLAY|")
        data = b""
        while chunk := await stream.receive_some(4):
            data += chunk
        read.append(data)
        return False

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.serve, take_over)
            await client.send_all(b"GET /events HTTP/1.1\r\nhost: a\r\n\r\nEARLY|")
            await trio.sleep(1)
            await client.send_all(b"LATER")
            await client.send_eof()
    assert read == [b"REPLAY|EARLY|LATER"]
