"""The pool's watcher: idle node connections close when the node closes them
and when ``--pool-idle-timeout`` runs out, with no further traffic.

The decisions (``sweep_idle``, ``next_expiry``) are tables; the expiry runs
the whole proxy under ``MockClock``; a node closing its side is a kernel fact,
checked over real 127.0.0.1 sockets by the process's descriptor count.
"""

from __future__ import annotations

import math
import os

import attrs
import pytest
import trio
import trio.testing
from test_pool import OK_HEAD, KeepAliveServer, exchanged, proxy_to

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.testing import FakeNode, Fleet, healthy, request, request_tcp, start_in_fleet
from trio_failover.wire.pool import WATCH_DELAY, ConnectionPool, next_expiry, sweep_idle

BODY = b'{"model": "m"}'


@attrs.define
class Idle:
    name: str
    idle_since: float
    chunked: bool = False
    dead: bool = False


def idle_list(spec: str, since: list[float]) -> list[Idle]:
    """``"ab!c"`` style: a name per entry, ``!`` after a name marks it readable."""
    entries: list[Idle] = []
    for char in spec:
        if char == "!":
            entries[-1].dead = True
        else:
            entries.append(Idle(char, since[len(entries)]))
    return entries


@pytest.mark.parametrize(
    ("spec", "since", "now", "closed", "left"),
    [
        ("", [], 5.0, [], []),
        ("abc", [1.0, 2.0, 3.0], 4.0, [], ["a", "b", "c"]),  # nothing due
        ("abc", [1.0, 2.0, 3.0], 5.0, ["a"], ["b", "c"]),  # "a" idle exactly 4 s
        ("abc", [1.0, 2.0, 3.0], 7.5, ["a", "b", "c"], []),
        ("ab!c", [1.0, 2.0, 3.0], 4.0, ["b"], ["a", "c"]),  # the node closed "b"
        ("a!b!", [1.0, 2.0], 1.5, ["a", "b"], []),
        ("ab!c!", [1.0, 2.0, 3.0], 5.0, ["a", "b", "c"], []),  # expired, then dead
    ],
)
def test_sweep_closes_the_expired_and_the_readable(
    spec: str, since: list[float], now: float, closed: list[str], left: list[str]
) -> None:
    idle = idle_list(spec, since)
    discarded = sweep_idle(idle, now=now, idle_timeout=4.0, dead=lambda entry: entry.dead)
    assert [entry.name for entry in discarded] == closed
    assert [entry.name for entry in idle] == left


@pytest.mark.parametrize(
    ("idle", "expected"),
    [
        ({}, math.inf),
        ({"a": []}, math.inf),
        ({"a": [1.0, 3.0]}, 5.0),  # the oldest of a node decides
        ({"a": [2.0], "b": [0.5, 9.0], "c": []}, 4.5),
    ],
)
def test_next_expiry_is_the_oldest_idle_plus_the_timeout(
    idle: dict[str, list[float]], expected: float
) -> None:
    lists = {node: [Idle("x", since) for since in times] for node, times in idle.items()}
    assert next_expiry(lists, 4.0) == expected


# -- expiry with no traffic, virtual time ---------------------------------------------------


async def test_an_idle_connection_closes_at_the_pool_idle_timeout_without_traffic(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, pool_idle_timeout=3.0)
        proxy = Proxy(config, connector=fleet.connector)
        async with trio.open_nursery() as nursery:
            await start_in_fleet(proxy)  # its own tasks: the pool's watcher among them
            await trio.sleep(1.0)
            response = await request(proxy, body=BODY)
            assert response is not None
            assert response.status == 200
            released = trio.current_time()
            await trio.sleep(2.0)
            response = await request(proxy, body=BODY)  # reused; idle again from now
            assert response is not None
            assert fleet["a"].connections == 1
            released = trio.current_time()
            await trio.sleep(10.0)  # no request: only the watcher can close it
            assert fleet["a"].closed_at == [released + 3.0]
            assert proxy.pool.idle_count("a") == 0
            nursery.cancel_scope.cancel()


async def test_the_watcher_takes_over_connections_idle_before_it_started(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = ConnectionPool(max_idle=4, idle_timeout=2.0)
    ours, theirs = trio.socket.socketpair()
    with theirs:
        await pool.release("a", trio.SocketStream(ours), exchanged(OK_HEAD))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.watch)
            await trio.sleep(1.999)
            assert pool.idle_count("a") == 1
            await trio.sleep(0.001)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.idle_count("a") == 0
            assert ours.fileno() == -1
            nursery.cancel_scope.cancel()


async def test_a_connection_released_while_the_watcher_sleeps_is_watched_within_the_delay(
    mock_clock: trio.testing.MockClock,
) -> None:
    # A release does not touch the epoll set; the watcher adds the
    # connection at its next look, WATCH_DELAY later at most, even while it
    # sleeps toward an expiry a minute away. The clock moves by hand: the
    # node's close is a kernel fact, which autojump could run past.
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    first, first_node = trio.socket.socketpair()
    second, second_node = trio.socket.socketpair()
    with first_node, second_node:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.watch)
            await trio.testing.wait_all_tasks_blocked()
            await pool.release("a", trio.SocketStream(first), exchanged(OK_HEAD))
            mock_clock.jump(WATCH_DELAY)
            await trio.testing.wait_all_tasks_blocked()  # it looked: "first" is watched
            await pool.release("a", trio.SocketStream(second), exchanged(OK_HEAD))
            second_node.close()  # the node closes the one released last
            await trio.testing.wait_all_tasks_blocked()
            assert pool.idle_count("a") == 2  # not looked at yet
            mock_clock.jump(WATCH_DELAY)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.idle_count("a") == 1
            assert second.fileno() == -1
            assert first.fileno() >= 0
            nursery.cancel_scope.cancel()


# -- a node closing its side, real sockets ----------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def fds_back_to(limit: int, within: float) -> int:
    """Poll the descriptor count until it is at most ``limit`` (bounded in time)."""
    with trio.move_on_after(within):
        # The descriptor count is a kernel fact no event reports: a bounded poll.
        while open_fds() > limit:  # noqa: ASYNC110
            await trio.sleep(0.01)
    return open_fds()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_after_a_burst_the_fd_count_returns_once_the_nodes_close(reset: bool) -> None:
    burst = 16
    server = KeepAliveServer(idle=0.3, reset=reset)
    with trio.fail_after(20):
        async with proxy_to(server, pool_idle_timeout=60.0) as address:
            await trio.testing.wait_all_tasks_blocked()  # the watcher has its epoll set
            baseline = open_fds()

            async def one() -> None:
                response = await request_tcp(address, body=BODY)
                assert response is not None
                assert response.status == 200

            async with trio.open_nursery() as clients:
                for _ in range(burst):
                    clients.start_soon(one)
            connections = server.connections
            assert connections > 1  # the burst really held several at once
            # The test's clients are gone; the proxy holds its pooled ones.
            await server.wait_closed(connections)
            closed = trio.current_time()
            assert await fds_back_to(baseline, within=1.0) <= baseline
            assert trio.current_time() - closed < 1.0
