"""The accept loop keeps serving: running out of file descriptors is logged
and retried after a pause (never a crash, never a busy loop), and one
connection's failure never takes the server down.

Real sockets on 127.0.0.1, no autojump clock.
"""

from __future__ import annotations

import errno
import itertools
import logging
import resource
import sys
from pathlib import Path

import pytest
import trio
from conftest import LogRecords
from support import serve_process

from trio_failover.core.config import Config
from trio_failover.proxy import Proxy
from trio_failover.service import server
from trio_failover.service.accept import accept_pending
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import FakeNode, Fleet, healthy

GET = b"GET /health HTTP/1.1\r\nHost: proxy.test\r\nConnection: close\r\n\r\n"
BODY = b'{"ok": true}'


async def get(address: tuple[str, int]) -> bytes:
    """One GET over a new connection; returns the raw answer up to the close."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(GET)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def fleet_and_config(fleet: Fleet) -> Config:
    node = await fleet.serve_tcp("a")
    return Config(upstreams=[node], listen="127.0.0.1:0", admin_listen=None)


def is_node(listener: trio.SocketListener, config: Config) -> bool:
    """Whether ``listener`` is the fake node's (patched accepts leave it alone)."""
    return bool(listener.socket.getsockname()[1] == config.upstreams[0].port)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS])
async def test_accept_out_of_resources_is_logged_and_retried_after_a_pause(
    monkeypatch: pytest.MonkeyPatch, logged: LogRecords, code: int
) -> None:
    calls: list[float] = []
    real_accept = trio.SocketListener.accept

    async def exhausted_three_times(self: trio.SocketListener) -> trio.SocketStream:
        if is_node(self, config):
            return await real_accept(self)
        calls.append(trio.current_time())
        if len(calls) <= 3:
            await trio.lowlevel.checkpoint()
            raise OSError(code, "out of resources")
        return await real_accept(self)

    async with Fleet({"a": FakeNode(healthy(BODY))}) as fleet:
        config = await fleet_and_config(fleet)
        monkeypatch.setattr(trio.SocketListener, "accept", exhausted_three_times)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(serve, config)
                answer = await get(bound.client)  # waits in the backlog meanwhile
                nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.endswith(BODY)
    # Three failures, three pauses, then the accept that served the client
    # (and the next one, waiting): not a busy loop.
    assert 4 <= len(calls) <= 5
    gaps = [later - earlier for earlier, later in itertools.pairwise(calls[:4])]
    assert all(gap >= 0.1 for gap in gaps), gaps  # the pause: 0.1 s
    assert logged.messages(logging.ERROR) == ["accept failed, retrying"] * 3


async def test_other_accept_errors_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    real_accept = trio.SocketListener.accept

    async def broken(self: trio.SocketListener) -> trio.SocketStream:
        if is_node(self, config):
            return await real_accept(self)
        await trio.lowlevel.checkpoint()
        raise OSError(errno.EINVAL, "the listener is broken")

    async with Fleet({"a": FakeNode()}) as fleet:
        config = await fleet_and_config(fleet)
        monkeypatch.setattr(trio.SocketListener, "accept", broken)
        with trio.fail_after(10), pytest.RaisesGroup(OSError, flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve, config)


async def test_a_failing_connection_does_not_stop_the_server(
    monkeypatch: pytest.MonkeyPatch, logged: LogRecords
) -> None:
    real = Proxy.handle_connection
    seen = 0

    async def fails_once(self: Proxy, stream: trio.abc.Stream, **kwargs: object) -> None:
        nonlocal seen
        seen += 1
        if seen == 1:
            raise RuntimeError("a bug in one connection")
        await real(self, stream, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Proxy, "handle_connection", fails_once)
    async with Fleet({"a": FakeNode(healthy(BODY))}) as fleet:
        config = await fleet_and_config(fleet)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(serve, config)
                assert await get(bound.client) == b""  # that connection is closed...
                answer = await get(bound.client)  # ...the server goes on
                nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert any(
        "a bug in one connection" in (r.exc_text or "") or r.exc_info for r in logged.records
    )


# -- a real process with a tiny descriptor limit ---------------------------------------------

FD_LIMIT = 64


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / 100  # USER_HZ, 100 on every Linux this runs on


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and sets RLIMIT_NOFILE")
async def test_process_out_of_descriptors_keeps_serving_without_spinning() -> None:
    async with Fleet({"a": FakeNode(healthy(BODY))}) as fleet:
        node = await fleet.serve_tcp("a")
        with trio.fail_after(30):
            async with serve_process(f"--upstream=a={node.url}", preexec_fn=_limit_fds) as proxy:
                process, bound, lines = proxy.process, proxy.address, proxy.lines
                # Hold more connections than the process has descriptors.
                holders = [await trio.open_tcp_stream(*bound) for _ in range(FD_LIMIT + 20)]
                await trio.sleep(0.5)
                before = _cpu_seconds(process.pid)
                await trio.sleep(1.0)
                spent = _cpu_seconds(process.pid) - before
                assert process.poll() is None, "the proxy died out of descriptors"
                failures = [line for line in lines if "accept failed, retrying" in line]
                assert failures, "\n".join(lines[-20:])
                assert "Too many open files" in failures[0]
                # Retrying every 0.1 s costs little; a busy loop burns a whole core.
                assert spent < 0.5, f"{spent:.2f} s of CPU in 1 s while out of descriptors"
                assert len(failures) < 40

                for stream in holders:
                    await stream.aclose()
                # Descriptors come back; the backlog drains; a request is served.
                for _ in range(50):
                    answer = await get(bound)
                    if answer.startswith(b"HTTP/1.1 200 "):
                        break
                    await trio.sleep(0.1)
                assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
                assert answer.endswith(BODY)
                process.terminate()
                assert await process.wait() == 0


# -- one pass takes every pending connection (issue 33) ----------------------------------------


async def pending_connections(count: int) -> tuple[trio.SocketListener, list[trio.SocketStream]]:
    """A loopback listener with ``count`` connections in its backlog, none accepted.

    On loopback the whole handshake runs inside the client's ``connect``, so
    each connection is in the listener's accept queue once it returns.
    """
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    clients = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(count)]
    return listener, clients


async def test_accept_pending_takes_the_whole_backlog_without_a_checkpoint() -> None:
    listener, clients = await pending_connections(5)
    limiter = trio.CapacityLimiter(10)
    started: list[tuple[trio.SocketStream, object]] = []
    async with listener:
        # Synchronous: nothing else runs between the accepts.
        assert accept_pending(listener, limiter, lambda s, t: started.append((s, t)), 100) == 5
        assert accept_pending(listener, limiter, lambda s, t: started.append((s, t)), 100) == 0
        assert limiter.borrowed_tokens == 5
        peers = {stream.socket.getpeername() for stream, _ in started}
        assert peers == {client.socket.getsockname() for client in clients}
        # The accepted streams work: a byte crosses each.
        for client in clients:
            await client.send_all(b"x")
        assert [await stream.receive_some(1) for stream, _ in started] == [b"x"] * 5
        for stream, token in started:
            limiter.release_on_behalf_of(token)
            await stream.aclose()
    for client in clients:
        await client.aclose()


async def test_accept_pending_stops_at_the_connection_limit() -> None:
    listener, clients = await pending_connections(5)
    limiter = trio.CapacityLimiter(3)
    started: list[tuple[trio.SocketStream, object]] = []
    async with listener:
        assert accept_pending(listener, limiter, lambda s, t: started.append((s, t)), 100) == 3
        assert limiter.available_tokens == 0  # the other two stay in the backlog
        for stream, token in started[:2]:
            limiter.release_on_behalf_of(token)
            await stream.aclose()
        assert accept_pending(listener, limiter, lambda s, t: started.append((s, t)), 100) == 2
        assert len(started) == 5
        for stream, token in started[2:]:
            limiter.release_on_behalf_of(token)
            await stream.aclose()
    for client in clients:
        await client.aclose()


async def test_accept_pending_takes_at_most_the_batch() -> None:
    listener, clients = await pending_connections(5)
    limiter = trio.CapacityLimiter(10)
    started: list[tuple[trio.SocketStream, object]] = []

    def start(stream: trio.SocketStream, token: object) -> None:
        started.append((stream, token))

    async with listener:
        assert [accept_pending(listener, limiter, start, 2) for _ in range(4)] == [2, 2, 1, 0]
        for stream, token in started:
            limiter.release_on_behalf_of(token)
            await stream.aclose()
    for client in clients:
        await client.aclose()


class StepCounter(trio.abc.Instrument):
    """How many times tasks of one function name were stepped."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.name):
            self.steps += 1


@pytest.mark.parametrize(("batch", "passes"), [(100, (1, 2)), (3, (3, 4))])
async def test_the_accept_loop_takes_a_backlog_in_one_pass(
    monkeypatch: pytest.MonkeyPatch, batch: int, passes: tuple[int, int]
) -> None:
    # Main of 2026-12-01 took two passes per connection (the limiter's
    # checkpoint and Trio's accept); under load each pass waits for every
    # ready stream's chunk, and new clients queued in the backlog.
    count = 8
    listener, clients = await pending_connections(count)
    handled: list[trio.SocketStream] = []
    all_handled = trio.Event()

    async def handle(
        stream: trio.SocketStream,
        proxy: object,
        limiter: trio.CapacityLimiter,
        token: object,
        *rest: object,
    ) -> None:
        handled.append(stream)
        if len(handled) == count:
            all_handled.set()
        limiter.release_on_behalf_of(token)
        await stream.aclose()

    monkeypatch.setattr(server, "_handle", handle)
    monkeypatch.setattr(server, "ACCEPT_BATCH", batch)
    counter = StepCounter("._accept_loop")
    trio.lowlevel.add_instrument(counter)
    try:
        with trio.fail_after(10):
            async with listener, trio.open_nursery() as nursery:
                limiter = trio.CapacityLimiter(100)
                nursery.start_soon(
                    server._accept_loop, listener, nursery, None, limiter, None, "http"
                )
                await all_handled.wait()
                steps = counter.steps
                nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(counter)
    # One step to the first accept's checkpoint, one that takes the other
    # seven and parks in the wait for more; in batches of three, a step per
    # batch (and the one that finds the backlog empty).
    assert passes[0] <= steps <= passes[1], steps
    for client in clients:
        await client.aclose()
