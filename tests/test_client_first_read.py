"""A new connection's request read in its task's first step (issue 33), over real loopback.

The request has nearly always arrived by the time the connection's task
runs; ``ClientConnection.serve`` takes it before the reader task has taken
a step, instead of waiting three passes of the scheduler for that task.
"""

from __future__ import annotations

import inspect
import socket
import struct
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from trio_failover.wire.client import ClientConnection, ClientRequest, Closed

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}"


@pytest.fixture
async def pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """A connected pair of plain TCP streams on 127.0.0.1: (the proxy's side, the client)."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    ours = await listener.accept()
    assert isinstance(ours, trio.SocketStream)
    yield ours, client
    for stream in (ours, client, listener):
        await trio.aclose_forcefully(stream)


def connection(stream: trio.abc.Stream) -> ClientConnection:
    return ClientConnection(stream, max_head=8192, max_body=8192, client_header_timeout=60)


def reader_started() -> bool:
    """Whether the connection's reader task (in ``serve``'s nursery) has taken a step."""
    nursery = trio.lowlevel.current_task().child_nurseries[-1]
    (reader,) = nursery.child_tasks
    return inspect.getcoroutinestate(reader.coro) != inspect.CORO_CREATED


async def serve_one(stream: trio.abc.Stream) -> tuple[list[ClientRequest], list[bool]]:
    """Serve ``stream`` until its first request: the request, and whether the reader had run."""
    got: list[ClientRequest] = []
    started: list[bool] = []

    async def handler(_: ClientConnection, request: ClientRequest) -> bool:
        got.append(request)
        started.append(reader_started())
        return False

    with trio.fail_after(5):
        await connection(stream).serve(handler)
    return got, started


async def test_a_request_already_there_reaches_the_handler_before_the_reader_runs(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, client = pair
    await client.send_all(REQUEST)
    got, started = await serve_one(ours)
    assert [(r.method, r.body) for r in got] == [(b"POST", b"{}")]
    assert started == [False]


async def test_a_request_not_yet_there_is_read_by_the_reader(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, client = pair
    async with trio.open_nursery() as nursery:

        async def send_later() -> None:
            await trio.testing.wait_all_tasks_blocked()
            await client.send_all(REQUEST)

        nursery.start_soon(send_later)
        got, started = await serve_one(ours)
    assert [(r.method, r.body) for r in got] == [(b"POST", b"{}")]
    assert started == [True]


async def test_a_stream_other_than_a_plain_socket_is_read_by_the_reader() -> None:
    client, ours = trio.testing.memory_stream_pair()
    await client.send_all(REQUEST)
    got, started = await serve_one(ours)
    assert [(r.method, r.body) for r in got] == [(b"POST", b"{}")]
    assert started == [True]


@pytest.mark.parametrize(("reset", "closed"), [(False, Closed.EOF), (True, Closed.RESET)])
async def test_a_client_gone_before_its_request_is_seen_as_it_left(
    pair: tuple[trio.SocketStream, trio.SocketStream], reset: bool, closed: Closed
) -> None:
    ours, client = pair
    if reset:  # close() sends an RST
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await client.aclose()
    served = connection(ours)

    async def handler(_: ClientConnection, request: ClientRequest) -> bool:
        raise AssertionError("no request was sent")

    with trio.fail_after(5):
        await served.serve(handler)
    assert served.closed is closed
