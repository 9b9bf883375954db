"""Every answer the proxy makes itself has its standard reason phrase (`401 Unauthorized`).

Over real 127.0.0.1 sockets to ``serve``, reading the raw status line: h11
sends whatever reason it is given, an empty one included (``HTTP/1.1 401 ``),
and a client library that shows the phrase, or a proxy in front that logs it,
then has nothing to show. Real clock (real sockets), no autojump.
"""

from __future__ import annotations

import functools
import json
from http import HTTPStatus

import pytest
import trio

from trio_failover import Config, Upstream
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import FakeNode, Fleet, NodeIO, ReceivedRequest, with_health

LIMIT = 20  # seconds of real time; each answer comes within a second

STREAMED = json.dumps({"model": "m", "stream": True, "messages": []}).encode()


def post(body: bytes, target: bytes = b"/v1/chat/completions") -> bytes:
    head = b"POST %s HTTP/1.1\r\nhost: proxy.test\r\ncontent-length: %d\r\n\r\n"
    return head % (target, len(body)) + body


async def status_line(address: tuple[str, int], data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; the first line of the answer, as it came."""
    stream = await trio.open_tcp_stream(*address)
    try:
        await stream.send_all(data)
        received = b""
        for _ in range(1000):  # bounded: a status line is one read or a few
            if b"\r\n" in received:
                break
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            received += chunk
        return received.split(b"\r\n", 1)[0]
    finally:
        await trio.aclose_forcefully(stream)


def expected(status: int) -> bytes:
    return b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode())


async def start(
    nursery: trio.Nursery, upstreams: list[Upstream], **settings: object
) -> BoundAddresses:
    config = Config(
        upstreams=upstreams,
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        discovery_interval=0,
        **settings,  # type: ignore[arg-type]
    )
    bound: BoundAddresses = await nursery.start(functools.partial(serve, config))
    return bound


ADMIN = [
    pytest.param(200, b"GET /healthz HTTP/1.1\r\nhost: a\r\n\r\n", id="200-healthz"),
    pytest.param(401, b"GET /status HTTP/1.1\r\nhost: a\r\n\r\n", id="401-no-token"),
    pytest.param(
        404, b"GET /nowhere HTTP/1.1\r\nhost: a\r\nauthorization: Bearer tok\r\n\r\n", id="404"
    ),
    pytest.param(
        405,
        b"DELETE /status HTTP/1.1\r\nhost: a\r\nauthorization: Bearer tok\r\n\r\n",
        id="405",
    ),
    pytest.param(400, b"NOT HTTP\r\n\r\n", id="400-malformed"),
]


@pytest.mark.parametrize(("status", "data"), ADMIN)
async def test_the_admin_listeners_answers_have_their_reason_phrase(
    status: int, data: bytes
) -> None:
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            bound = await start(nursery, [Upstream("a", "http://127.0.0.1:9")], admin_token="tok")
            assert bound.admin is not None
            assert await status_line(bound.admin, data) == expected(status)
            nursery.cancel_scope.cancel()


CLIENT = [
    pytest.param(400, b"NOT HTTP\r\n\r\n", id="400-malformed"),
    pytest.param(
        431, b"GET / HTTP/1.1\r\nhost: p\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n", id="431"
    ),
    pytest.param(413, post(b"x" * 2000), id="413"),
    pytest.param(408, b"GET / HTTP/1.1\r\n", id="408-slow-head"),
    pytest.param(404, post(json.dumps({"model": "other"}).encode()), id="404-no-model"),
    pytest.param(502, post(json.dumps({"model": "r", "stream": True}).encode()), id="502"),
    pytest.param(504, post(STREAMED), id="504"),
    pytest.param(503, post(STREAMED), id="503-queue-timeout"),
]


@pytest.mark.parametrize(("status", "data"), CLIENT)
async def test_the_client_listeners_own_answers_have_their_reason_phrase(
    status: int, data: bytes
) -> None:
    # "m" is served by a node whose engine never answers (its web server
    # does: the liveness check passes, the header timeout ends the attempt:
    # 504); with its one slot taken, the next request waits past the queue
    # timeout (503). Model "r" is served at a closed port (502).
    posted = trio.Event()

    async def engine(io: NodeIO, received: ReceivedRequest) -> None:
        if received.method == b"POST":
            posted.set()
        await io.wait_closed()

    async with Fleet({"m": FakeNode(with_health(engine))}) as fleet:
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                closed = trio.socket.socket()  # bound, never listening: refused
                await closed.bind(("127.0.0.1", 0))
                port = closed.getsockname()[1]
                node = await fleet.serve_tcp("m")
                bound = await start(
                    nursery,
                    [
                        Upstream("m", node.url, models=["m"], capacity=1),
                        Upstream("refused", f"http://127.0.0.1:{port}", models=["r"]),
                    ],
                    max_request_body=1000,
                    client_header_timeout=0.2,
                    response_header_timeout=0.5,
                    queue_timeout=0.2,
                )
                if status == 503:
                    nursery.start_soon(status_line, bound.client, data)  # takes the slot
                    await posted.wait()
                assert await status_line(bound.client, data) == expected(status)
                closed.close()
                nursery.cancel_scope.cancel()
