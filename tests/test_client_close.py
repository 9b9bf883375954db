"""The downstream-close watcher: a departed client stops costing GPU time.

FIN versus RST and pipelined bytes are kernel behaviour, so most tests here
use real loopback sockets and the real clock (never autojump while real I/O
is in flight). One test checks the exact timing in virtual time.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import h11
import pytest
import trio

from trio_failover import Config, Subscription
from trio_failover.proxy import Proxy
from trio_failover.service.server import serve
from trio_failover.testing import (
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    frozen,
    healthy,
    read_response,
    request,
)
from trio_failover.wire.client import ClientConnection, Closed

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\n\r\n{}"


@asynccontextmanager
async def serving(
    nodes: dict[str, FakeNode], **settings: object
) -> AsyncIterator[tuple[Fleet, tuple[str, int], Proxy]]:
    """The proxy in front of ``nodes`` on real sockets, with its ``Proxy`` for its events."""
    settings.setdefault("discovery_interval", 0)  # the nodes watch their connections
    async with Fleet(nodes) as fleet:
        upstreams = [await fleet.serve_tcp(name) for name in nodes]
        config = Config(
            upstreams=upstreams,
            listen="127.0.0.1:0",
            admin_listen=None,
            **settings,  # type: ignore[arg-type]
        )
        proxy = Proxy(config)
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(partial(serve, config, proxy=proxy))
            yield fleet, addresses.client, proxy
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def running_proxy(
    nodes: dict[str, FakeNode], **settings: object
) -> AsyncIterator[tuple[Fleet, tuple[str, int]]]:
    async with serving(nodes, **settings) as (fleet, address, _proxy):
        yield fleet, address


async def wait_finished(events: Subscription) -> dict[str, Any]:
    """The next workload event that says the workload ended."""
    async for event in events:
        if event["type"] == "workload" and event["state"] in ("completed", "failed", "cancelled"):
            return event
    raise AssertionError(f"the event bus closed: {events.dropped}")


async def connect(address: tuple[str, int]) -> trio.SocketStream:
    return await trio.open_tcp_stream(*address)


def reset_on_close(stream: trio.SocketStream) -> None:
    """SO_LINGER on with a zero timeout: close() sends an RST, not a FIN."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def wait_closed_by_proxy(node: FakeNode, limit: float) -> float:
    with trio.fail_after(limit):
        while not node.closed_at:  # noqa: ASYNC110 - polling a plain list, bounded by fail_after
            await trio.sleep(0.01)
    return node.closed_at[0]


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_client_leaving_before_first_byte_cancels_the_attempt(how: str) -> None:
    silent, healthy_node = FakeNode(frozen()), FakeNode(healthy())
    nodes = {"silent": silent, "good": healthy_node}
    async with serving(nodes) as (_fleet, address, proxy):
        with proxy.events.subscribe() as events:
            client = await connect(address)
            await client.send_all(REQUEST)
            with trio.fail_after(5):
                await silent.first_request.wait()
            await trio.sleep(0.3)
            if how == "rst":
                reset_on_close(client)
            left_at = trio.current_time()
            await client.aclose()
            closed_at = await wait_closed_by_proxy(silent, 5)
            assert closed_at - left_at < 0.5
            with trio.fail_after(5):
                finished = await wait_finished(events)
        # The workload is over: a failover would have happened before its end.
        assert (finished["state"], finished["node"]) == ("cancelled", "silent")
        assert healthy_node.received == []  # no failover for a departed client


async def answer_after(delay: float) -> object:
    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.pause(delay)
        await healthy(b"answered")(io, request)

    return behave


async def test_rst_only_serves_a_half_closed_client_but_cancels_on_reset() -> None:
    slow = FakeNode(await answer_after(1.0))  # type: ignore[arg-type]
    async with running_proxy({"slow": slow}, client_close="rst-only") as (fleet, address):
        client = await connect(address)
        await client.send_all(REQUEST)
        await client.send_eof()  # shutdown(SHUT_WR): done sending, still listening
        conn = h11.Connection(h11.CLIENT)
        conn.send(
            h11.Request(method="POST", target="/", headers=[("host", "p"), ("content-length", "2")])
        )
        conn.send(h11.Data(data=b"{}"))
        conn.send(h11.EndOfMessage())
        with trio.fail_after(5):
            response = await read_response(client, conn)
        assert (response.status, response.body) == (200, b"answered")
        await client.aclose()

        silent = FakeNode(frozen())
        fleet.nodes["slow"] = silent  # same upstream address, new behaviour
        client = await connect(address)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            await silent.first_request.wait()
        reset_on_close(client)
        left_at = trio.current_time()
        await client.aclose()
        assert await wait_closed_by_proxy(silent, 5) - left_at < 0.5


async def test_ignore_lets_the_workload_run_to_its_end() -> None:
    arrived = trio.Event()

    async def answer_later(io: NodeIO, request: ReceivedRequest) -> None:
        arrived.set()
        await io.pause(1.0)
        await healthy(b"answered")(io, request)

    slow = FakeNode(answer_later)
    async with running_proxy({"slow": slow}, client_close="ignore") as (_fleet, address):
        for how in ("fin", "rst"):
            slow.closed_at.clear()
            arrived = trio.Event()
            client = await connect(address)
            await client.send_all(REQUEST)
            with trio.fail_after(5):
                await arrived.wait()  # the node is working on it
            if how == "rst":
                reset_on_close(client)
            left_at = trio.current_time()
            await client.aclose()
            # The node is allowed to finish: its connection closes only after
            # it answered, about one second after the request.
            closed_at = await wait_closed_by_proxy(slow, 5)
            assert closed_at - left_at > 0.6


async def test_client_abort_mid_stream_closes_the_node_connection() -> None:
    async def gap(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        )
        await io.send(h11.Data(data=b"data: 1\n\n"))
        await io.pause(2.0)
        await io.send(h11.Data(data=b"data: 2\n\n"), h11.EndOfMessage())

    streamer = FakeNode(gap)
    async with running_proxy({"streamer": streamer}) as (_fleet, address):
        client = await connect(address)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            first = await client.receive_some(65536)
        assert b"data: 1" in first
        left_at = trio.current_time()
        await client.aclose()  # in the middle of the two-second gap
        assert await wait_closed_by_proxy(streamer, 5) - left_at < 0.5


async def test_pipelined_requests_are_answered_in_order() -> None:
    async def echo_path(io: NodeIO, request: ReceivedRequest) -> None:
        if request.target == b"/slow":
            await trio.sleep(0.5)
        await healthy(request.target + b":" + request.body)(io, request)

    async with running_proxy({"echo": FakeNode(echo_path)}) as (_fleet, address):
        client = await connect(address)
        first = b"POST /slow HTTP/1.1\r\nHost: p\r\nContent-Length: 5\r\n\r\nfirst"
        second = b"POST /fast HTTP/1.1\r\nHost: p\r\nContent-Length: 6\r\n\r\nsecond"
        await client.send_all(first + second)  # one write: both arrive together
        conn = h11.Connection(h11.CLIENT)
        conn.send(
            h11.Request(method="POST", target="/", headers=[("host", "p"), ("content-length", "0")])
        )
        conn.send(h11.EndOfMessage())
        with trio.fail_after(5):
            one = await read_response(client, conn)
            conn.start_next_cycle()
            conn.send(
                h11.Request(
                    method="POST", target="/", headers=[("host", "p"), ("content-length", "0")]
                )
            )
            conn.send(h11.EndOfMessage())
            two = await read_response(client, conn)
        assert one.body == b"/slow:first"
        assert two.body == b"/fast:second"
        await client.aclose()


async def test_client_leaving_at_30s_ends_the_attempt_at_30s(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "peer": FakeNode(healthy())}) as fleet:
        # No liveness question (it would find the node down at 20 s): the
        # client leaves first.
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, liveness_interval=0)
        proxy = Proxy(config, connector=fleet.connector)
        assert await request(proxy, body=b"{}", leave_after=30.0) is None
        assert await wait_closed_by_proxy(fleet["frozen"], 1) == 30.0
        assert fleet["peer"].received == []
        assert proxy.cooldowns.active(trio.current_time()) == []
        (workload,) = proxy.recent
        assert workload["state"] == "cancelled"
        assert [(a["node"], a["outcome"]) for a in workload["attempts"]] == [
            ("frozen", "client_abort")
        ]


async def test_client_abort_is_not_a_node_failure(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"frozen": FakeNode(frozen())}) as fleet:
        config = attrs.evolve(Config(upstreams=fleet.upstreams()), admin_listen=None)
        proxy = Proxy(config, connector=fleet.connector)
        await request(proxy, body=b"{}", leave_after=5.0)
        await trio.sleep(1)
        (node,) = proxy.status()["nodes"]
        assert (node["failed"], node["state"], node["in_flight"]) == (0, "ready", 0)


async def test_watcher_started_after_the_client_left_sees_it_at_once() -> None:
    # A workload that begins after the reader saw the FIN must still be
    # cancelled: wait_closed reports a close that already happened.
    client, server = trio.testing.memory_stream_pair()
    connection = ClientConnection(server, max_head=8192, max_body=8192, client_header_timeout=60)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection.run_reader)
        await client.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert connection.closed is Closed.EOF
        with trio.fail_after(1):
            assert await connection.wait_closed() is Closed.EOF


async def test_watcher_sees_a_reset_while_it_waits() -> None:
    _client, server = trio.testing.memory_stream_pair()
    connection = ClientConnection(server, max_head=8192, max_body=8192, client_header_timeout=60)
    seen: list[Closed] = []

    async def watch() -> None:
        seen.append(await connection.wait_closed())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection.run_reader)
        nursery.start_soon(watch)
        await trio.testing.wait_all_tasks_blocked()
        assert seen == []
        await server.aclose()  # the reader's receive then fails: an error, not a FIN
    assert seen == [Closed.RESET]
