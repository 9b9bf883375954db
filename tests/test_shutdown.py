"""Graceful shutdown: stop accepting, let in-flight workloads finish within
``shutdown_timeout``, then cancel them; a second signal stops at once.

The first tests drive ``serve(shutdown=...)`` in this process; the last ones
run the real command line in a subprocess and send it signals. Real sockets
on 127.0.0.1, no autojump clock.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import h11
import pytest
import trio
import trio.testing
from conftest import LogRecords
from support import ProxyProcess, serve_process

from trio_failover.core.config import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import (
    ClientResponse,
    FakeNode,
    Fleet,
    healthy,
    read_response,
    request,
    slow_head,
    start_in_fleet,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# How long a proxy process may take to exit once nothing holds it: far below
# the 30 s drain a wrong exit would wait, with room for a host loaded enough
# to give a process a fraction of a core (interpreter teardown included).
PROMPT = 10.0

CHUNKS = [b"data: %d\n\n" % i for i in range(7)]
TERMINAL = {"completed", "failed", "cancelled"}
STREAM_BODY = b"".join(CHUNKS)


def streaming(seconds: float, chunks: Sequence[bytes] = CHUNKS) -> FakeNode:
    """A node that streams ``chunks`` evenly over ``seconds`` (first one at once)."""
    delay = seconds / (len(chunks) - 1)
    return FakeNode(healthy(list(chunks), chunk_delay=delay, content_length=False))


@attrs.define
class Reply:
    """A response read off a real socket, chunk by chunk."""

    status: int = 0
    body: bytes = b""
    complete: bool = False
    first_chunk: trio.Event = attrs.Factory(trio.Event)


async def fetch(address: tuple[str, int], reply: Reply) -> None:
    """POST to the proxy and read the response into ``reply``."""
    stream = await trio.open_tcp_stream(*address)
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[("host", "proxy.test"), ("content-length", "2")],
    )
    await stream.send_all(conn.send(request) + conn.send(h11.Data(data=b"{}")))
    await stream.send_all(conn.send(h11.EndOfMessage()))
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    return  # closed before the end of the body
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                reply.status = event.status_code
            elif isinstance(event, h11.Data):
                reply.body += event.data
                reply.first_chunk.set()
            elif isinstance(event, h11.EndOfMessage):
                reply.complete = True
                return
    finally:
        await stream.aclose()


async def refuses(address: tuple[str, int]) -> bool:
    """Whether the listener is gone (a connect is refused)."""
    try:
        stream = await trio.open_tcp_stream(*address)
    except OSError:
        return True
    await stream.aclose()
    return False


def config_for(node: Upstream, *, shutdown_timeout: float) -> Config:
    return Config(
        upstreams=[node],
        listen="127.0.0.1:0",
        admin_listen=None,
        shutdown_timeout=shutdown_timeout,
    )


# -- serve(shutdown=...) in this process -----------------------------------------------------


async def test_drain_lets_an_in_flight_stream_finish_and_stops_accepting(
    logged: LogRecords,
) -> None:
    async with Fleet({"a": streaming(1.5)}) as fleet:
        config = config_for(await fleet.serve_tcp("a"), shutdown_timeout=10.0)
        shutdown = trio.Event()
        reply = Reply()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(
                    partial(serve, config, shutdown=shutdown)
                )
                async with trio.open_nursery() as clients:
                    clients.start_soon(fetch, bound.client, reply)
                    await reply.first_chunk.wait()
                    shutdown.set()
                    # serve() closes its listeners and logs "draining" without
                    # waiting on anything: once every task waits, it has.
                    await trio.testing.wait_all_tasks_blocked()
                    assert "draining" in logged.messages(logging.INFO)
                    assert await refuses(bound.client)
                    assert not reply.complete
            # serve() returned by itself: the drain ended with the stream.
        assert reply.status == 200
        assert reply.body == STREAM_BODY
        assert reply.complete


async def test_drain_closes_idle_keepalive_connections_at_once() -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        config = config_for(await fleet.serve_tcp("a"), shutdown_timeout=10.0)
        shutdown = trio.Event()
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(
                    partial(serve, config, shutdown=shutdown)
                )
                stream = await trio.open_tcp_stream(*bound.client)
                await stream.send_all(b"GET / HTTP/1.1\r\nHost: proxy.test\r\n\r\n")
                data = b""
                while not data.endswith(b'{"ok": true}'):
                    data += await stream.receive_some(65536)
                started = trio.current_time()
                shutdown.set()
                assert await stream.receive_some(65536) == b""  # closed by the drain
                assert trio.current_time() - started < 1.0  # not after 75 s of keep-alive
                await stream.aclose()


async def test_drain_cancels_what_outlives_the_shutdown_timeout(logged: LogRecords) -> None:
    async with Fleet({"a": streaming(30.0)}) as fleet:
        config = config_for(await fleet.serve_tcp("a"), shutdown_timeout=0.5)
        shutdown = trio.Event()
        reply = Reply()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(
                    partial(serve, config, shutdown=shutdown)
                )
                nursery.start_soon(fetch, bound.client, reply)
                await reply.first_chunk.wait()
                started = trio.current_time()
                shutdown.set()
            elapsed = trio.current_time() - started
        assert 0.5 <= elapsed < 2.0
        assert reply.status == 200
        assert reply.body == CHUNKS[0]
        assert not reply.complete  # cut short: never a false end of stream
        # The cut workload still has its access line (issue 32).
        [access] = [r.fields for r in logged.records if r.name == "trio_failover.access"]  # type: ignore[attr-defined]
        assert (access["state"], access["reason"], access["nodes"]) == (
            "cancelled",
            "shutdown",
            ["a:shutdown"],
        )


# -- the end of a drain under MockClock: every workload ends with its event and access line --


async def drained(
    proxy: Proxy, body: bytes, *, drain_at: float, shutdown_timeout: float
) -> tuple[ClientResponse, list[dict[str, Any]]]:
    """One request on an in-memory connection; at ``drain_at`` the drain of ``serve()`` begins.

    As ``serve()`` drains: ``begin_drain``, then the connections' nursery
    gets ``shutdown_timeout`` to end. Returns the response and every event.
    """
    near, far = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    head = [("host", "proxy.test"), ("content-length", str(len(body)))]
    responses: list[ClientResponse] = []

    async def client() -> None:
        request = h11.Request(method="POST", target="/v1/chat/completions", headers=head)
        await near.send_all(conn.send(request) + conn.send(h11.Data(data=body)))
        await near.send_all(conn.send(h11.EndOfMessage()))
        responses.append(await read_response(near, conn))

    await start_in_fleet(proxy)
    with proxy.events.subscribe(0) as events, trio.fail_after(3600):
        async with trio.open_nursery() as clients:
            clients.start_soon(client)
            async with trio.open_nursery() as connections:
                connections.start_soon(proxy.handle_connection, far)
                await trio.sleep(drain_at)
                proxy.begin_drain()
                connections.cancel_scope.deadline = trio.current_time() + shutdown_timeout
        published = []
        while True:
            try:
                published.append(events.receive.receive_nowait())
            except trio.WouldBlock:
                break
    return responses[0], published


def access_lines(logged: LogRecords) -> list[dict[str, Any]]:
    return [r.fields for r in logged.records if r.name == "trio_failover.access"]  # type: ignore[attr-defined]


async def test_a_stream_cut_at_the_end_of_the_drain_ends_cancelled_with_reason_shutdown(
    autojump_clock: trio.testing.MockClock, logged: LogRecords
) -> None:
    # Streams a chunk every 10 s for 60 s; the drain begins at t=12 with 5 s.
    async with Fleet({"a": streaming(60.0)}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        body = b'{"model": "m", "stream": true}'
        response, published = await drained(proxy, body, drain_at=12.0, shutdown_timeout=5.0)
    assert response.status == 200
    assert not response.complete  # cut, never a false end
    assert response.at == 17.0
    assert [at for at, _ in response.chunks] == [0.0, 10.0]
    [access] = access_lines(logged)
    assert (access["state"], access["reason"], access["status"]) == ("cancelled", "shutdown", 200)
    assert access["nodes"] == ["a:shutdown"]
    assert (access["commit_ms"], access["duration_ms"]) == (0.0, 17000.0)
    assert access["bytes"] == len(CHUNKS[0] + CHUNKS[1])
    terminal = [e for e in published if e["type"] == "workload" and e["state"] in TERMINAL]
    assert len(terminal) == 1
    assert published[-1] is terminal[0]  # the terminal event comes last
    [event] = terminal
    assert (event["state"], event["reason"], event["node"]) == ("cancelled", "shutdown", "a")
    assert [(a["node"], a["outcome"], a["elapsed_ms"]) for a in event["attempts"]] == [
        ("a", "shutdown", 17000.0)
    ]
    [recent] = proxy.recent
    assert (recent["state"], recent["reason"]) == ("cancelled", "shutdown")
    assert proxy.status()["nodes"][0]["state"] == "ready"  # never the node's fault


async def test_a_workload_not_yet_answered_at_the_end_of_the_drain_gets_503(
    autojump_clock: trio.testing.MockClock, logged: LogRecords
) -> None:
    # A long generation answered whole: nothing was sent when the drain ends.
    async with Fleet({"a": FakeNode(slow_head(100.0))}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        response, published = await drained(
            proxy, b'{"model": "m"}', drain_at=1.0, shutdown_timeout=5.0
        )
    assert (response.status, response.complete, response.at) == (503, True, 6.0)
    assert response.json()["error"]["code"] == "shutting_down"
    assert response.header("connection") == "close"
    assert response.header("retry-after") is not None
    [access] = access_lines(logged)
    assert (access["state"], access["reason"], access["status"]) == ("cancelled", "shutdown", 503)
    assert access["nodes"] == ["a:shutdown"]
    assert access["commit_ms"] is None
    [event] = [e for e in published if e["type"] == "workload" and e["state"] in TERMINAL]
    assert (event["state"], event["reason"], event["status"]) == ("cancelled", "shutdown", 503)
    assert len(fleet["a"].closed_at) == 1  # the node's connection closed, not pooled


async def test_a_client_that_left_is_cancelled_with_reason_client_abort(
    autojump_clock: trio.testing.MockClock, logged: LogRecords
) -> None:
    async with Fleet({"a": FakeNode(slow_head(100.0))}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        assert await request(proxy, body=b"{}", leave_after=3.0) is None
        await trio.testing.wait_all_tasks_blocked()
    [access] = access_lines(logged)
    assert (access["state"], access["reason"], access["nodes"]) == (
        "cancelled",
        "client_abort",
        ["a:client_abort"],
    )
    assert proxy.recent[-1]["reason"] == "client_abort"


async def test_a_workload_that_ends_normally_has_no_reason(
    autojump_clock: trio.testing.MockClock, logged: LogRecords
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        response = await request(proxy, body=b"{}")
    assert response is not None
    assert response.status == 200
    [access] = access_lines(logged)
    assert "reason" not in access
    assert "reason" not in proxy.recent[-1]


async def test_answer_committed_during_a_drain_says_connection_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Without it, a keep-alive client may send its next request just as the
    # proxy closes the connection, and lose it without an answer.
    async with Fleet({"a": FakeNode(slow_head(2.0))}) as fleet:
        config = Config(upstreams=fleet.upstreams(), admin_listen=None)
        proxy = await start_in_fleet(Proxy(config, connector=fleet.connector))
        near, far = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.handle_connection, far)
            await near.send_all(b"GET / HTTP/1.1\r\nHost: proxy.test\r\n\r\n")
            await trio.sleep(1.0)
            proxy.begin_drain()
            answer = b""
            while chunk := await near.receive_some(65536):
                answer += chunk
            nursery.cancel_scope.cancel()
    head = answer.partition(b"\r\n\r\n")[0].lower()
    assert b"\r\nconnection: close" in head


# -- the command line in a subprocess --------------------------------------------------------


@asynccontextmanager
async def proxy_process(node: Upstream, *options: str) -> AsyncIterator[ProxyProcess]:
    """``trio-failover serve`` for one node in a subprocess, on a free port."""
    async with serve_process(f"--upstream={node.name}={node.url}", *options) as proxy:
        yield proxy


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_during_a_3_second_stream_lets_it_complete_then_exits_0(
    signum: signal.Signals,
) -> None:
    async with Fleet({"a": streaming(3.0)}) as fleet:
        node = await fleet.serve_tcp("a")
        reply = Reply()
        with trio.fail_after(20):
            async with proxy_process(node) as proxy, trio.open_nursery() as clients:
                clients.start_soon(fetch, proxy.address, reply)
                await reply.first_chunk.wait()
                signalled = trio.current_time()
                proxy.process.send_signal(signum)
                await proxy.lines.wait_for("draining")  # logged once the listener is closed
                assert await refuses(proxy.address)  # stopped accepting
                assert proxy.process.poll() is None  # still draining
                returncode = await proxy.process.wait()
                exited = trio.current_time() - signalled
        assert reply.body == STREAM_BODY
        assert reply.complete
        assert returncode == 0, "\n".join(proxy.lines)
        assert 2.0 < exited < 3.0 + PROMPT  # it waited for the stream, then no longer
        assert any(f"{signum.name}: shutting down" in line for line in proxy.lines)


async def test_idle_proxy_exits_0_at_once_on_sigterm() -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        node = await fleet.serve_tcp("a")
        with trio.fail_after(20):
            async with proxy_process(node) as proxy:
                signalled = trio.current_time()
                proxy.process.send_signal(signal.SIGTERM)
                returncode = await proxy.process.wait()
                assert trio.current_time() - signalled < PROMPT
        assert returncode == 0


async def test_second_sigterm_during_a_long_stream_exits_promptly() -> None:
    async with Fleet({"a": streaming(60.0)}) as fleet:
        node = await fleet.serve_tcp("a")
        reply = Reply()
        with trio.fail_after(20):
            async with (
                proxy_process(node, "--shutdown-timeout=30s") as proxy,
                trio.open_nursery() as clients,
            ):
                clients.start_soon(fetch, proxy.address, reply)
                await reply.first_chunk.wait()
                proxy.process.send_signal(signal.SIGTERM)
                await proxy.lines.wait_for("draining")  # the first signal was handled
                assert proxy.process.poll() is None  # draining: it would wait 30 s
                signalled = trio.current_time()
                proxy.process.send_signal(signal.SIGTERM)
                returncode = await proxy.process.wait()
                stopped = trio.current_time() - signalled
        assert stopped < PROMPT  # not the 30 s drain
        assert returncode == 1  # forced: not a clean drain
        assert not reply.complete  # the client sees a cut stream, not a false end
        assert any("second signal" in line for line in proxy.lines)


# -- /healthz during a drain -------------------------------------------------------------------


async def healthz(address: tuple[str, int]) -> tuple[int, bytes]:
    """``GET /healthz`` on the admin listener: (status, body)."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(
            b"GET /healthz HTTP/1.1\r\nHost: admin.test\r\nConnection: close\r\n\r\n"
        )
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_healthz_answers_503_once_the_drain_begins() -> None:
    async with Fleet({"a": streaming(1.5)}) as fleet:
        node = await fleet.serve_tcp("a")
        config = attrs.evolve(config_for(node, shutdown_timeout=10.0), admin_listen="127.0.0.1:0")
        shutdown = trio.Event()
        reply = Reply()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(
                    partial(serve, config, shutdown=shutdown)
                )
                assert bound.admin is not None
                assert await healthz(bound.admin) == (200, b"ok")
                nursery.start_soon(fetch, bound.client, reply)
                await reply.first_chunk.wait()
                shutdown.set()
                await trio.testing.wait_all_tasks_blocked()
                # The stream keeps the drain going; the admin listener stays up.
                assert await healthz(bound.admin) == (503, b"draining")
        assert reply.complete


async def test_healthz_of_a_real_process_answers_503_after_sigterm() -> None:
    async with Fleet({"a": streaming(3.0)}) as fleet:
        node = await fleet.serve_tcp("a")
        reply = Reply()
        with trio.fail_after(20):
            async with (
                proxy_process(node, "--admin-listen=127.0.0.1:0") as proxy,
                trio.open_nursery() as clients,
            ):
                line = await proxy.lines.wait_for("admin on http://")
                host, _, port = line.rpartition("http://")[2].rpartition(":")
                admin = (host, int(port))
                assert await healthz(admin) == (200, b"ok")
                clients.start_soon(fetch, proxy.address, reply)
                await reply.first_chunk.wait()
                proxy.process.send_signal(signal.SIGTERM)
                await proxy.lines.wait_for("draining")
                assert await healthz(admin) == (503, b"draining")
                assert await proxy.process.wait() == 0
        assert reply.complete
