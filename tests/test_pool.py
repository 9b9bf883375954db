"""Keep-alive connection pools to nodes.

The decisions (``take_idle``, ``put_idle``, ``is_reusable``) are tables of
cases with an explicit ``now``. The rules around them run the whole proxy on
in-memory streams under ``MockClock`` (exact expiry times), and the case of a
node that closes an idle connection runs on real sockets and the real clock.
"""

from __future__ import annotations

import functools
import gc
import select
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import attrs
import h11
import pytest
import trio
import trio.testing
import trustme

from trio_failover import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.service.server import serve
from trio_failover.testing import (
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    die_mid_stream,
    healthy,
    request,
    request_tcp,
    retry_status,
    start_in_fleet,
    stream_then_silence,
)
from trio_failover.wire.pool import ConnectionPool, is_reusable, put_idle, take_idle, unread

BODY = b'{"model": "m"}'
# Streamed: the response-header timeout bounds its head. BODY is unstreamed,
# so --unstreamed-timeout (10 min) bounds its head instead, and
# no test of a header deadline may use it.
STREAMED = b'{"model": "m", "stream": true}'


# -- the pure decisions -----------------------------------------------------------


@attrs.define
class Idle:
    name: str
    idle_since: float
    chunked: bool = False


def names(entries: list[Idle]) -> list[str]:
    return [entry.name for entry in entries]


@pytest.mark.parametrize(
    ("idle_since", "now", "taken", "discarded", "left"),
    [
        ([], 10.0, None, [], []),
        ([1.0, 2.0, 3.0], 3.5, "c", [], ["a", "b"]),  # newest first (LIFO)
        ([1.0, 2.0, 3.0], 5.0, "c", ["a"], ["b"]),  # "a" idle exactly 4 s: expired
        ([1.0, 2.0, 3.0], 5.999, "c", ["a"], ["b"]),
        ([1.0, 2.0, 3.0], 6.5, "c", ["a", "b"], []),
        ([1.0, 2.0, 3.0], 7.0, None, ["a", "b", "c"], []),  # all expired
    ],
)
def test_take_idle_is_lifo_and_drops_expired(
    idle_since: list[float], now: float, taken: str | None, discarded: list[str], left: list[str]
) -> None:
    idle = [Idle(name, since) for name, since in zip("abc", idle_since, strict=False)]
    entry, expired = take_idle(idle, now=now, idle_timeout=4.0)
    assert (entry.name if entry else None) == taken
    assert names(expired) == discarded
    assert names(idle) == left


@pytest.mark.parametrize(
    ("idle_since", "now", "max_idle", "idle_timeout", "discarded", "kept"),
    [
        ([], 1.0, 2, 4.0, [], ["new"]),
        ([0.5], 1.0, 2, 4.0, [], ["a", "new"]),
        ([0.5, 0.7], 1.0, 2, 4.0, ["a"], ["b", "new"]),  # the oldest goes beyond max_idle
        ([0.5, 0.7], 1.0, 1, 4.0, ["a", "b"], ["new"]),
        ([0.5, 3.0], 4.5, 2, 4.0, ["a"], ["b", "new"]),  # expired, not over the bound
        ([0.5], 1.0, 0, 4.0, ["new"], ["a"]),  # pooling off: nothing is kept
        ([0.5], 1.0, 2, 0.0, ["new"], ["a"]),
    ],
)
def test_put_idle_bounds_and_expires(
    idle_since: list[float],
    now: float,
    max_idle: int,
    idle_timeout: float,
    discarded: list[str],
    kept: list[str],
) -> None:
    idle = [Idle(name, since) for name, since in zip("ab", idle_since, strict=False)]
    closed = put_idle(idle, Idle("new", now), now=now, idle_timeout=idle_timeout, max_idle=max_idle)
    assert names(closed) == discarded
    assert names(idle) == kept


def exchanged(response: h11.Response, body: bytes = b"ok", *, extra: bytes = b"") -> h11.Connection:
    """A client h11 connection after one request and the given answer."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "n")]))
    conn.send(h11.EndOfMessage())
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"GET / HTTP/1.1\r\nhost: n\r\n\r\n")
    server.next_event()
    server.next_event()
    data = server.send(response) or b""
    data += server.send(h11.Data(data=body)) or b""
    data += server.send(h11.EndOfMessage()) or b""
    conn.receive_data(data + extra)
    while not isinstance(conn.next_event(), h11.EndOfMessage):
        pass
    return conn


OK_HEAD = h11.Response(status_code=200, headers=[("content-length", "2")])


def test_reusable_after_a_clean_exchange() -> None:
    assert is_reusable(exchanged(OK_HEAD))


def test_not_reusable_when_the_node_says_close() -> None:
    close = h11.Response(
        status_code=200, headers=[("content-length", "2"), ("connection", "close")]
    )
    assert not is_reusable(exchanged(close))


def test_not_reusable_with_bytes_after_the_response() -> None:
    assert not is_reusable(exchanged(OK_HEAD, extra=b"HTTP/1.1 200 OK\r\n"))


def test_not_reusable_before_the_response_ended() -> None:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "n")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab")
    while conn.next_event() is not h11.NEED_DATA:
        pass
    assert not is_reusable(conn)


# -- the rules, whole proxy, virtual time ----------------------------------------------


def make_proxy(fleet: Fleet, **settings: object) -> Proxy:
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


async def ok(proxy: Proxy, body: bytes = BODY) -> float:
    response = await request(proxy, body=body)
    assert response is not None
    assert (response.status, response.complete) == (200, True)
    assert response.header("x-failover-attempts") == "1"
    return response.at


async def test_a_complete_response_leaves_its_connection_for_the_next_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy(b"one"))}) as fleet:
        proxy = make_proxy(fleet)
        for _ in range(3):
            await ok(proxy)
        assert fleet["a"].connections == 1
        assert len(fleet["a"].received) == 3
        assert proxy.pool.idle_count("a") == 1
        await proxy.pool.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert fleet["a"].closed_at == [trio.current_time()]


@pytest.mark.parametrize(
    ("idle_timeout", "reused_at", "fresh_at"), [(4.0, 3.999, 4.0), (0.5, 0.499, 0.5)]
)
async def test_an_idle_connection_expires_after_the_pool_idle_timeout(
    autojump_clock: trio.abc.Clock, idle_timeout: float, reused_at: float, fresh_at: float
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        settings = {} if idle_timeout == 4.0 else {"pool_idle_timeout": idle_timeout}
        proxy = make_proxy(fleet, **settings)
        assert proxy.config.pool_idle_timeout == idle_timeout
        await ok(proxy)  # released at t=0
        await trio.sleep(reused_at)
        await ok(proxy)  # idle a hair under the limit: reused
        assert fleet["a"].connections == 1
        released = trio.current_time()
        await trio.sleep(fresh_at)
        await ok(proxy)  # idle exactly the limit: expired, closed, not reused
        assert fleet["a"].connections == 2
        assert fleet["a"].closed_at == [released + fresh_at]


async def test_pool_idle_timeout_zero_turns_pooling_off(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, pool_idle_timeout=0.0)
        await ok(proxy)
        await ok(proxy)
        assert fleet["a"].connections == 2
        assert proxy.pool.idle_count("a") == 0


def answers_by_path(
    delays: dict[bytes, float],
) -> Callable[[NodeIO, ReceivedRequest], Awaitable[None]]:
    """Answers with the connection's id after a delay chosen by the request path."""

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        await io.pause(delays.get(received.target, 0.0))
        await healthy(b"%d" % id(io))(io, received)

    return behave


async def test_reuse_is_last_in_first_out_and_bounded_per_node(
    autojump_clock: trio.abc.Clock,
) -> None:
    node = FakeNode(answers_by_path({b"/one": 1.0, b"/two": 2.0, b"/three": 3.0}))
    async with Fleet({"a": node}) as fleet:
        proxy = make_proxy(fleet, pool_max_idle=2)
        answers: dict[str, bytes] = {}

        async def fetch(path: str) -> None:
            response = await request(proxy, target=path, body=BODY)
            assert response is not None
            answers[path] = response.body

        async with trio.open_nursery() as nursery:
            for path in ("/one", "/two", "/three"):
                nursery.start_soon(fetch, path)
        # Released at t=1, 2 and 3; the bound of 2 closed the oldest (t=1).
        assert node.connections == 3
        assert node.closed_at == [3.0]
        assert proxy.pool.idle_count("a") == 2
        await fetch("/next")
        assert answers["/next"] == answers["/three"]  # the newest idle one
        await fetch("/after")
        assert answers["/after"] == answers["/next"]  # released again, newest again
        assert node.connections == 3


async def test_a_cancelled_attempt_closes_its_connection(autojump_clock: trio.abc.Clock) -> None:
    node = FakeNode(answers_by_path({b"/slow": 10.0}))
    async with Fleet({"a": node}) as fleet:
        proxy = make_proxy(fleet)
        await ok(proxy)  # one pooled connection
        leaving = trio.current_time()
        assert await request(proxy, target="/slow", body=BODY, leave_after=5.0) is None
        assert node.closed_at == [leaving + 5.0]  # closed, not pooled
        assert proxy.pool.idle_count("a") == 0
        await ok(proxy)
        assert node.connections == 2


@pytest.mark.parametrize(
    "behaviour",
    [
        pytest.param(die_mid_stream(2), id="node-died-mid-stream"),
        pytest.param(stream_then_silence(2, 400.0), id="stream-idle-timeout"),
    ],
)
async def test_a_response_not_read_to_its_end_is_never_pooled(
    autojump_clock: trio.abc.Clock, behaviour: Callable[[NodeIO, ReceivedRequest], Awaitable[None]]
) -> None:
    async with Fleet({"a": FakeNode(behaviour)}) as fleet:
        proxy = make_proxy(fleet, liveness_interval=0)  # no checks' connections to count
        response = await request(proxy, body=BODY)
        assert response is not None
        assert not response.complete
        await trio.testing.wait_all_tasks_blocked()
        assert proxy.pool.idle_count("a") == 0
        assert len(fleet["a"].closed_at) == 1


async def test_a_client_that_left_under_ignore_does_not_pool_the_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(answers_by_path({b"/slow": 2.0}))}) as fleet:
        proxy = make_proxy(fleet, client_close="ignore")
        assert await request(proxy, target="/slow", body=BODY, leave_after=1.0) is None
        await trio.sleep(5)
        assert fleet["a"].closed_at == [2.0]  # read to its end, then closed
        assert proxy.pool.idle_count("a") == 0


async def test_a_retryable_answer_closes_its_connection(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"busy": FakeNode(retry_status(503)), "b": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.header("x-failover-node") == "b"
        await trio.testing.wait_all_tasks_blocked()
        assert len(fleet["busy"].closed_at) == 1
        assert proxy.pool.idle_count("busy") == 0
        assert proxy.pool.idle_count("b") == 1


async def test_a_node_that_says_connection_close_is_not_pooled(
    autojump_clock: trio.abc.Clock,
) -> None:
    closing = healthy(b"bye", headers=[("content-type", "text/plain"), ("connection", "close")])
    async with Fleet({"a": FakeNode(closing)}) as fleet:
        proxy = make_proxy(fleet)
        await ok(proxy)
        await ok(proxy)
        assert fleet["a"].connections == 2
        assert proxy.pool.idle_count("a") == 0


def closes_idle_connection(
    after: float, answer_delay: float = 0.0
) -> Callable[[NodeIO, ReceivedRequest], Awaitable[None]]:
    """Answers the first request of a connection; the next one, ``after`` seconds
    after it arrives, finds the connection closed, as when a node's keep-alive
    timer crosses a request in flight."""
    used: set[int] = set()

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        if id(io) in used:
            await trio.sleep(after)
            await io.stream.aclose()
            return
        used.add(id(io))
        await io.pause(answer_delay)
        await healthy(b"fresh")(io, received)

    return behave


def closes_after_answering(
    answer_delay: float = 0.0,
) -> Callable[[NodeIO, ReceivedRequest], Awaitable[None]]:
    """Answers a connection's first request, then closes it, keep-alive though it said:
    the proxy's next write on it fails, as when a node's keep-alive timer
    closed the connection before the request reached it."""
    answered: set[int] = set()

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        await io.pause(answer_delay if answered else 0.0)
        answered.add(id(io))
        await healthy(b"fresh")(io, received)
        await io.stream.aclose()

    return behave


async def test_a_pooled_connection_whose_write_fails_sends_the_request_on_a_fresh_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Nothing of the request reached the node: it goes out once, on a new connection."""
    async with Fleet({"a": FakeNode(closes_after_answering()), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        await ok(proxy)
        await trio.testing.wait_all_tasks_blocked()
        assert proxy.pool.idle_count("a") == 1  # pooled: the close is not seen yet
        await ok(proxy)  # no failover to "b"
        posts = [r for r in fleet["a"].received if r.method == b"POST"]
        assert (len(posts), fleet["a"].connections) == (2, 2)  # each POST reached a once
        assert fleet["b"].received == []
        assert [[a["outcome"] for a in w["attempts"]] for w in proxy.recent] == [
            ["completed"],
            ["completed"],
        ]
        text, _ = proxy.metrics.render()
        assert b'trio_failover_stale_resends_total{node="a"} 1.0' in text


@pytest.mark.parametrize("after", [0.0, 0.25, 3.0, 15.0])
async def test_a_pooled_connection_closed_after_the_write_is_a_failed_attempt(
    autojump_clock: trio.abc.Clock, after: float
) -> None:
    """The node may have read the request: never sent twice; the next candidate, no cooldown."""
    async with Fleet({"a": FakeNode(closes_idle_connection(after)), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        await ok(proxy)
        started = trio.current_time()
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.at == started + after  # not twice ``after``
        assert response.header("x-failover-node") == "b"
        assert response.header("x-failover-attempts") == "2"
        posts = [r for r in fleet["a"].received if r.method == b"POST"]
        assert len(posts) == 2  # the second POST went to "a" once
        assert [a["outcome"] for a in proxy.recent[-1]["attempts"]] == [
            "closed_early",
            "completed",
        ]
        assert not proxy.cooldowns.is_cooling("a", trio.current_time())


async def test_a_resend_whose_connect_fails_is_one_failed_attempt(
    autojump_clock: trio.abc.Clock,
) -> None:
    node = FakeNode(closes_after_answering())
    async with Fleet({"a": node, "b": FakeNode(healthy(b"b"))}) as fleet:
        proxy = make_proxy(fleet)
        await ok(proxy)
        node.refuse = True  # the node went away: the fresh connect fails
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.body == b"b"
        assert response.header("x-failover-attempts") == "2"
        assert [a["outcome"] for a in proxy.recent[-1]["attempts"]] == [
            "connect_failed",
            "completed",
        ]


# -- a node that closes idle connections, real sockets ------------------------------------


@attrs.define
class KeepAliveServer:
    """An HTTP/1.1 server that closes a connection idle for ``idle`` seconds,
    as uvicorn does after 5 s (with an RST instead of a FIN when ``reset``)."""

    idle: float
    reset: bool = False
    connections: int = 0
    requests: int = 0
    closed: int = 0
    _closing: trio.Event = attrs.field(factory=trio.Event, init=False)

    async def wait_closed(self, count: int) -> None:
        """Wait until this server has closed ``count`` connections in all."""
        for _ in range(count):  # each close sets the event once: bounded
            if self.closed >= count:
                return
            await self._closing.wait()
        assert self.closed >= count

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                with trio.move_on_after(self.idle if conn.their_state is h11.IDLE else 30):
                    event = conn.next_event()
                    while event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                        event = conn.next_event()
                if event is h11.NEED_DATA:  # idle too long
                    break
                if isinstance(event, h11.Request):
                    self.requests += 1
                elif isinstance(event, h11.EndOfMessage):
                    await stream.send_all(
                        (
                            conn.send(
                                h11.Response(status_code=200, headers=[("content-length", "2")])
                            )
                            or b""
                        )
                        + (conn.send(h11.Data(data=b"ok")) or b"")
                        + (conn.send(h11.EndOfMessage()) or b"")
                    )
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    break
        except (trio.BrokenResourceError, h11.ProtocolError):
            pass
        finally:
            if self.reset:
                stream.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            await trio.aclose_forcefully(stream)
            self.closed += 1
            self._closing.set()
            self._closing = trio.Event()


class NodeServer(Protocol):
    """A node on 127.0.0.1 that serves each accepted connection with ``handle``."""

    async def handle(self, stream: trio.SocketStream) -> None: ...


@asynccontextmanager
async def proxy_to(server: NodeServer, **settings: object) -> AsyncIterator[tuple[str, int]]:
    """A proxy (real sockets) in front of ``server``, one node, no health checks."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        config = Config(
            upstreams=[Upstream("node", f"http://127.0.0.1:{port}")],
            listen="127.0.0.1:0",
            admin_listen=None,
            discovery_interval=0,  # the node counts its connections: no checks
            **settings,  # type: ignore[arg-type]
        )
        addresses = await nursery.start(serve, config)
        yield addresses.client
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_a_connection_the_node_closed_while_idle_is_replaced_transparently(
    reset: bool,
) -> None:
    server = KeepAliveServer(idle=0.2, reset=reset)
    with trio.fail_after(10):
        async with proxy_to(server, pool_idle_timeout=30.0) as address:
            for served in range(1, 4):
                response = await request_tcp(address, body=BODY)
                assert response is not None
                assert (response.status, response.body) == (200, b"ok")
                assert response.header("x-failover-attempts") == "1"
                await server.wait_closed(served)  # the node closed the idle connection
    assert server.connections == 3
    assert server.requests == 3  # each went out once: the stale write reached nobody


async def test_a_pool_idle_timeout_below_the_node_keepalive_avoids_stale_connections() -> None:
    server = KeepAliveServer(idle=2.0)
    with trio.fail_after(10):
        async with proxy_to(server, pool_idle_timeout=0.3) as address:
            for pause in (0.05, 0.6, 0.05):
                response = await request_tcp(address, body=BODY)
                assert response is not None
                assert response.status == 200
                await trio.sleep(pause)
    assert server.connections == 2  # one reuse after 0.05 s; a fresh one after 0.6 s
    assert server.requests == 3


async def test_a_relay_cancelled_at_its_last_write_closes_the_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The answer is complete when the client stops reading; the proxy's last
    # write waits on it; the client leaves and the workload is cancelled in
    # that write. The connection is clean by HTTP's rules but was abandoned.
    async with Fleet({"a": FakeNode(healthy(b"x" * 1000))}) as fleet:
        proxy = await start_in_fleet(make_proxy(fleet))
        client, server = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.handle_connection, server)
            await client.send_all(
                b"POST / HTTP/1.1\r\nhost: p\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
            )
            await trio.sleep(5)
            await client.aclose()
        assert fleet["a"].received
        await trio.testing.wait_all_tasks_blocked()
        assert proxy.pool.idle_count("a") == 0
        assert fleet["a"].closed_at == [5.0]


async def test_a_dropped_pool_closes_its_idle_sockets() -> None:
    # Without pool.aclose() (an embedder that forgets it), the sockets must
    # not wait for the garbage collector's ResourceWarning.
    pool = ConnectionPool(max_idle=4, idle_timeout=4.0)
    ours, theirs = trio.socket.socketpair()
    await pool.release("a", trio.SocketStream(ours), exchanged(OK_HEAD))
    assert pool.idle_count("a") == 1
    del pool
    gc.collect()
    assert ours.fileno() == -1
    with theirs:
        assert await theirs.recv(10) == b""  # the other end sees the close


# -- the checkout check, real sockets ------------------------------------------------------


def idle_pair() -> tuple[trio.SocketStream, socket.socket]:
    """A TCP connection on 127.0.0.1: a trio stream for the pool, the node's end as a socket."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    ours.setblocking(False)
    return trio.SocketStream(trio.socket.from_stdlib_socket(ours)), theirs


@pytest.mark.parametrize(
    ("node_does", "expected"),
    [
        ("nothing", None),
        ("bytes", "bytes"),
        ("close", "eof"),
        ("reset", "eof"),
    ],
)
async def test_unread_tells_what_waits_on_an_idle_socket(
    node_does: str, expected: str | None
) -> None:
    stream, node = idle_pair()
    with node:
        if node_does == "bytes":
            node.sendall(b"HTTP/1.1 200 OK\r\n")
        elif node_does == "reset":
            node.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            node.close()
        elif node_does == "close":
            node.close()
        if node_does != "nothing":  # the kernel's news takes a moment on loopback
            await trio.lowlevel.wait_readable(stream.socket)
        assert unread(stream, select.poll()) == expected
    await stream.aclose()


async def test_checkout_closes_a_connection_with_stray_bytes_and_takes_the_next() -> None:
    strays: list[str] = []
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0, on_stray=strays.append)
    older, older_node = idle_pair()
    newer, newer_node = idle_pair()
    with older_node, newer_node:
        await pool.release("a", older, exchanged(OK_HEAD))
        await pool.release("a", newer, exchanged(OK_HEAD))
        newer_node.sendall(b"POISON-D")  # after a complete answer: nobody asked
        await trio.lowlevel.wait_readable(newer.socket)
        entry = await pool.acquire("a")
        assert entry is not None
        assert entry.stream is older
        assert strays == ["a"]
        assert newer.socket.fileno() == -1  # closed, never used
        await entry.stream.aclose()


async def test_checkout_closes_a_connection_at_eof_without_a_count() -> None:
    strays: list[str] = []
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0, on_stray=strays.append)
    stream, node = idle_pair()
    await pool.release("a", stream, exchanged(OK_HEAD))
    node.close()
    await trio.lowlevel.wait_readable(stream.socket)
    assert await pool.acquire("a") is None
    assert strays == []
    assert stream.socket.fileno() == -1


async def test_bytes_that_came_with_the_answer_end_are_stray_too() -> None:
    strays: list[str] = []
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0, on_stray=strays.append)
    stream, node = idle_pair()
    with node:
        await pool.release("a", stream, exchanged(OK_HEAD, extra=b"HTTP/1.1 200 OK\r\n"))
    assert pool.idle_count("a") == 0
    assert strays == ["a"]


# -- the checkout check on TLS: the TLS object's buffers, and records decrypted to tell ----


async def tls_pair(
    transport: tuple[trio.abc.Stream, trio.abc.Stream], version: ssl.TLSVersion
) -> tuple[trio.SSLStream[trio.abc.Stream], trio.SSLStream[trio.abc.Stream]]:
    """A handshaken TLS connection over ``transport``: (the pool's side, the node's side)."""
    ca = trustme.CA()
    node_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("node.test").configure_cert(node_context)
    node_context.maximum_version = version
    our_context = ssl.create_default_context()
    ca.configure_trust(our_context)
    ours = trio.SSLStream(transport[0], our_context, server_hostname="node.test")
    theirs = trio.SSLStream(transport[1], node_context, server_side=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ours.do_handshake)
        nursery.start_soon(theirs.do_handshake)
    return ours, theirs


async def test_unread_sees_tls_records_that_came_with_the_answer() -> None:
    # Two records in one read: the SSL object decrypts the first (the
    # answer), the second waits in Trio's MemoryBIO, unseen by h11 and by
    # a poll of the socket (in-memory here: there is none).
    ours, theirs = await tls_pair(trio.testing.memory_stream_pair(), ssl.TLSVersion.TLSv1_3)
    await theirs.send_all(b"answer")
    await theirs.send_all(b"POISON-D")
    await trio.testing.wait_all_tasks_blocked()
    assert await ours.receive_some(65536) == b"answer"
    assert unread(ours, select.poll()) == "bytes"


@pytest.mark.parametrize(
    "version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"]
)
@pytest.mark.parametrize(
    ("node_does", "expected"), [("nothing", None), ("bytes", "bytes"), ("close_notify", "eof")]
)
async def test_unread_on_tls_tells_stray_data_from_a_close_notify(
    version: ssl.TLSVersion, node_does: str, expected: str | None
) -> None:
    # In TLS 1.3 every record is "application data" on the wire, a
    # close_notify too: only decrypting tells them apart.
    a, b = trio.socket.socketpair()
    sockets = (trio.SocketStream(a), trio.SocketStream(b))
    ours, theirs = await tls_pair(sockets, version)
    await theirs.send_all(b"answer")
    assert await ours.receive_some(65536) == b"answer"
    if node_does == "bytes":
        await theirs.send_all(b"POISON-D")
    elif node_does == "close_notify":
        await theirs.aclose()
    if node_does != "nothing":
        await trio.lowlevel.wait_readable(sockets[0].socket)
    assert unread(ours, select.poll()) == expected
    await trio.aclose_forcefully(ours)
    await trio.aclose_forcefully(theirs)
