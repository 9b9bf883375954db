"""``--workers N`` with real processes on real loopback: one port, lines printed once,
a dead worker started again, SIGTERM drains them all; and the pure decisions (core/workers.py).

Every wait is for a log line or a process's exit, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from conftest import RedisServer
from support import Lines

from trio_failover.core.config import Config, Upstream
from trio_failover.core.workers import RESTART_FIRST, RESTART_MOST, restart_delay, worker_config
from trio_failover.service.roster import LINE_MOST, Roster, WorkerEntry, encode, send

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")

LIMIT = 60.0


@attrs.define
class Supervisor:
    process: trio.Process
    lines: Lines
    # Set at the end of stderr: every process that shares it (the workers
    # inherit the supervisor's) has exited.
    stderr_closed: trio.Event = attrs.Factory(trio.Event)

    async def worker_pid(self, index: int, after: int = 0) -> int:
        """The pid of worker ``index`` as the supervisor logs it, from line ``after`` on."""
        line = await self.lines.wait_for(f"worker serving worker={index} pid=", after)
        return int(line.rpartition("pid=")[2].split()[0])

    async def address(self, what: str) -> tuple[str, int]:
        line = await self.lines.wait_for(f"{what} on http://")
        found = re.search(rf"{what} on http://(\S+?):(\d+)\b", line)
        assert found is not None
        return found[1], int(found[2])


@asynccontextmanager
async def supervisor(*options: str) -> AsyncIterator[Supervisor]:
    command = [sys.executable, "-m", "trio_failover", "serve", "--listen=127.0.0.1:0"]
    command += ["--admin-listen=127.0.0.1:0", "--discovery-interval=0", "--shutdown-timeout=2s"]
    async with spawned([*command, *options]) as sup:
        yield sup


@asynccontextmanager
async def spawned(command: list[str], *, drain: bool = False) -> AsyncIterator[Supervisor]:
    """``command`` running, its stderr read line by line; killed at the end.

    ``drain``: at the end of the block, ``SIGTERM`` first and an exit 0 asserted.
    """
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    sup = Supervisor(process, Lines())

    async def read_stderr() -> None:
        assert process.stderr is not None
        buffer = b""
        while chunk := await process.stderr.receive_some(65536):
            *done, buffer = (buffer + chunk).split(b"\n")
            for raw in done:
                sup.lines.append(raw.decode(errors="replace"))
        sup.stderr_closed.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stderr)
            yield sup
            if drain:
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
            nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


def listening_sockets(port: int) -> int:
    """How many TCP sockets on this host listen on ``port`` (``/proc/net/tcp``)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        count += state == "0A" and int(local.rpartition(":")[2], 16) == port
    return count


def metrics_dir(pid: int) -> Path:
    """The directory a worker's supervisor gave it for the metrics (its environment)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = entry.partition(b"=")
        if name == b"PROMETHEUS_MULTIPROC_DIR":
            return Path(value.decode())
    raise AssertionError(f"worker {pid} has no PROMETHEUS_MULTIPROC_DIR")


async def http_get(address: tuple[str, int], path: str) -> bytes:
    """One request on a fresh connection; the whole answer (the proxy closes it)."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        await stream.send_all(request.encode())
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
        return answer


async def test_two_workers_share_the_port_restart_and_drain(redis_server: RedisServer) -> None:
    state = f"--state=redis://127.0.0.1:{redis_server.port}"
    with trio.fail_after(LIMIT):
        async with supervisor("--upstream=a=http://127.0.0.1:9", "--workers=2", state) as sup:
            client = await sup.address("listening")
            admin = await sup.address("admin")
            first = [await sup.worker_pid(0), await sup.worker_pid(1)]
            # One socket a worker on the one port (SO_REUSEPORT), none elsewhere.
            assert listening_sockets(client[1]) == 2
            for _ in range(8):  # spread over both sockets by the kernel's hash
                assert (await http_get(client, "/v1/models")).startswith(b"HTTP/1.1 ")
            assert (await http_get(admin, "/healthz")).startswith(b"HTTP/1.1 200 ")

            # A worker killed outright is started again, on the same socket.
            seen = len(sup.lines)
            os.kill(first[1], signal.SIGKILL)
            await sup.lines.wait_for("worker exited: starting it again")
            second = [first[0], await sup.worker_pid(1, after=seen)]
            assert second[1] != first[1]
            for _ in range(4):
                assert (await http_get(client, "/v1/models")).startswith(b"HTTP/1.1 ")

            # Printed once, whatever the workers did.
            assert sum("listening on" in entry for entry in sup.lines) == 1
            assert sum("admin on" in entry for entry in sup.lines) == 1

            sup.process.send_signal(signal.SIGTERM)
            assert await sup.process.wait() == 0
            assert sum("draining" in entry for entry in sup.lines) == 2
            for pid in second:
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)


async def fleet_workers(admin: tuple[str, int], want: Callable[[list[Any]], bool]) -> list[Any]:
    """The ``workers`` of ``/status`` once ``want`` holds of them: the supervisor's line
    reaches the first worker's thread a moment after the log line it follows."""
    for _ in range(200):  # bounded: 200 polls, a few seconds at most
        answer = await http_get(admin, "/status")
        workers = json.loads(answer.partition(b"\r\n\r\n")[2])["workers"]
        if want(workers):
            return list(workers)
        await trio.sleep(0.02)
    raise AssertionError(f"/status never showed the workers wanted: {workers}")


async def test_the_first_workers_status_lists_the_workers(redis_server: RedisServer) -> None:
    state = f"--state=redis://127.0.0.1:{redis_server.port}"
    with trio.fail_after(LIMIT):
        async with supervisor("--upstream=a=http://127.0.0.1:9", "--workers=2", state) as sup:
            admin = await sup.address("admin")
            pids = [await sup.worker_pid(0), await sup.worker_pid(1)]
            listed = await fleet_workers(admin, lambda ws: all(w["serving"] for w in ws))
            assert [(w["index"], w["pid"], w["restarts"]) for w in listed] == [
                (0, pids[0], 0),
                (1, pids[1], 0),
            ]
            assert all(0 <= w["uptime_s"] < LIMIT for w in listed)

            # Worker 1 killed: listed again with its new pid, started once more.
            seen = len(sup.lines)
            os.kill(pids[1], signal.SIGKILL)
            second = await sup.worker_pid(1, after=seen)
            listed = await fleet_workers(admin, lambda ws: ws[1]["pid"] == second)
            assert (listed[1]["restarts"], listed[1]["serving"]) == (1, True)
            assert listed[0] == {**listed[0], "pid": pids[0], "restarts": 0}

            # The first worker itself killed: its successor is told the list afresh.
            seen = len(sup.lines)
            os.kill(pids[0], signal.SIGKILL)
            first = await sup.worker_pid(0, after=seen)
            listed = await fleet_workers(admin, lambda ws: ws[0]["pid"] == first)
            assert [(w["pid"], w["restarts"]) for w in listed] == [(first, 1), (second, 1)]


@attrs.define
class HoldingNode:
    """A node on 127.0.0.1 that answers ``/health`` at once and holds every other
    request until ``release`` is set; ``held`` counts the requests it holds now."""

    release: trio.Event = attrs.Factory(trio.Event)
    held: int = 0
    changed: trio.Event = attrs.Factory(trio.Event)

    def _tell(self, change: int) -> None:
        self.held += change
        self.changed.set()
        self.changed = trio.Event()

    async def wait_held(self, count: int) -> None:
        while self.held != count:  # each change sets the event: bounded by the caller
            await self.changed.wait()

    async def handle(self, stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            request += chunk
        if not request.startswith(b"GET /health "):
            self._tell(+1)
            try:
                with trio.CancelScope() as scope:
                    # The proxy closes it when its client leaves: stop holding.
                    async def closed() -> None:
                        await stream.receive_some(1)
                        scope.cancel()

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(closed)
                        await self.release.wait()
                        nursery.cancel_scope.cancel()
            finally:
                self._tell(-1)
            if scope.cancelled_caught:
                return
        body = b'{"ok": true}'
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(head + body)


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def accepted_by(pid: int, server_port: int, client_port: int) -> bool:
    """Whether process ``pid`` holds the accepted end of 127.0.0.1:client_port -> server_port."""
    inodes = socket_inodes(pid)
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if (
            int(local.rpartition(":")[2], 16) == server_port
            and int(remote.rpartition(":")[2], 16) == client_port
            and inode in inodes
        ):
            return True
    return False


async def test_the_admin_listener_says_503_until_the_last_worker_has_drained(
    redis_server: RedisServer,
) -> None:
    # The first worker serves the fleet's admin listener. Drained before
    # another worker is, it keeps that listener while the other drains:
    # a load balancer's /healthz gets 503, not a refusal or silence.
    state = f"--state=redis://127.0.0.1:{redis_server.port}"
    node = HoldingNode()
    async with trio.open_nursery() as nodes:
        listeners = await nodes.start(
            functools.partial(trio.serve_tcp, node.handle, 0, host="127.0.0.1")
        )
        upstream = f"--upstream=a=http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        with trio.fail_after(LIMIT):
            async with supervisor(upstream, "--workers=2", state, "--shutdown-timeout=60s") as sup:
                client = await sup.address("listening")
                admin = await sup.address("admin")
                second = await sup.worker_pid(1)
                await sup.worker_pid(0)
                # A request held at the node by worker 1: the kernel spreads
                # connections by their ports, so try until one lands there.
                held = None
                for _ in range(64):  # each lands on worker 1 one time in two
                    stream = await trio.open_tcp_stream(*client)
                    body = b'{"model": "m"}'
                    await stream.send_all(
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(body), body)
                    )
                    await node.wait_held(1)
                    port = stream.socket.getsockname()[1]
                    if accepted_by(second, client[1], port):
                        held = stream
                        break
                    await stream.aclose()  # worker 0's: the client leaves, so does its attempt
                    await node.wait_held(0)
                assert held is not None
                async with held:
                    sup.process.send_signal(signal.SIGTERM)
                    await sup.lines.wait_for("the admin listener stays until the other workers end")
                    answer = await http_get(admin, "/healthz")
                    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
                    node.release.set()
                    answer = b""
                    while chunk := await held.receive_some(65536):
                        answer += chunk
                    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
                assert await sup.process.wait() == 0
        nodes.cancel_scope.cancel()


async def test_a_single_proxys_status_has_no_workers() -> None:
    with trio.fail_after(LIMIT):
        async with supervisor("--upstream=a=http://127.0.0.1:9") as sup:
            admin = await sup.address("admin")
            answer = await http_get(admin, "/status")
            assert "workers" not in json.loads(answer.partition(b"\r\n\r\n")[2])
            sup.process.send_signal(signal.SIGTERM)
            assert await sup.process.wait() == 0


async def test_workers_whose_supervisor_was_killed_drain_and_exit(
    redis_server: RedisServer,
) -> None:
    state = f"--state=redis://127.0.0.1:{redis_server.port}"
    with trio.fail_after(LIMIT):
        async with supervisor("--upstream=a=http://127.0.0.1:9", "--workers=2", state) as sup:
            await sup.lines.wait_for("listening on")
            directory = metrics_dir(await sup.worker_pid(0))
            sup.process.kill()
            await sup.process.wait()
            # Each worker noticed, drained, and exited (closing its stderr).
            await sup.stderr_closed.wait()
            assert sum("draining" in line for line in sup.lines) == 2
            assert not directory.exists()  # the workers removed the metrics' directory


async def test_a_taken_port_stops_the_supervisor_with_exit_2(redis_server: RedisServer) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "trio_failover", "serve", f"--listen=127.0.0.1:{port}"]
        command += ["--upstream=http://127.0.0.1:9", "--workers=2", "--admin-listen=off"]
        command.append(f"--state=redis://127.0.0.1:{redis_server.port}")
        done = await trio.run_process(command, capture_stderr=True, check=False)
    assert done.returncode == 2
    assert done.stderr.decode().startswith(
        f"trio-failover: error: --listen: invalid value '127.0.0.1:{port}'"
    )


# -- the pure decisions ----------------------------------------------------------------------


def test_each_worker_keeps_the_addresses_as_written_and_only_the_first_the_admin() -> None:
    config = Config(
        upstreams=[Upstream("a", "http://127.0.0.1:9")],
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        state="redis://r:6379",
        workers=3,
    )
    first = worker_config(config, 0)
    assert (first.listen, first.admin_listen, first.workers) == ("127.0.0.1:0", "127.0.0.1:0", 3)
    other = worker_config(config, 2)
    assert (other.listen, other.admin_listen) == ("127.0.0.1:0", None)


@pytest.mark.parametrize(
    ("failures", "lived", "delay"),
    [
        (1, 0.0, RESTART_FIRST),
        (2, 0.0, 2 * RESTART_FIRST),
        (3, 1.0, 4 * RESTART_FIRST),
        (20, 1.0, RESTART_MOST),
        (20, 30.0, RESTART_FIRST),  # it had run steadily: not a crash loop
    ],
)
def test_restart_delay(failures: int, lived: float, delay: float) -> None:
    assert restart_delay(failures, lived) == delay


def test_a_roster_line_is_dropped_when_the_pipe_is_full_and_the_last_whole_line_wins() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        line = encode([WorkerEntry(1, pid=7, restarts=2, serving=True), WorkerEntry(0, pid=6)])
        assert send(write_end, line)
        while send(write_end, line):  # bounded by the pipe's size
            pass
        assert not send(write_end, b"x" * (LINE_MOST + 1))  # would arrive in pieces
        os.close(write_end)
        write_end = -1
        roster = Roster()
        roster.follow(read_end)  # to the end of the pipe; closes it
        read_end = -1
        assert [(w["index"], w["pid"], w["restarts"]) for w in roster.document()] == [
            (0, 6, 0),
            (1, 7, 2),
        ]
        roster.take(b"not json")
        assert len(roster.document()) == 2
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


async def test_others_gone_waits_for_a_line_that_lists_no_other_process() -> None:
    roster = Roster()
    both = [WorkerEntry(0, pid=10, serving=True), WorkerEntry(1, pid=11, serving=True)]
    roster.take(encode(both))
    assert roster.others_running()
    read_end, write_end = os.pipe()
    follower = threading.Thread(target=roster.follow, args=(read_end,), daemon=True)
    follower.start()
    try:
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                gone = trio.Event()

                async def wait() -> None:
                    await roster.others_gone()
                    gone.set()

                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                assert not gone.is_set()
                # The first worker's own exit is no news: the others are what count.
                first_only = [WorkerEntry(0, pid=None), WorkerEntry(1, pid=None)]
                os.write(write_end, encode(first_only))
                await gone.wait()
        assert not roster.others_running()
    finally:
        os.close(write_end)
        follower.join(LIMIT)
