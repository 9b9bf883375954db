"""A reload of ``--workers N``, with real processes on real loopback.

``SIGHUP`` to the supervisor reaches every worker, each of which reads the
config file again; a listener change is refused by all of them alike; a
worker started again after a reload starts with the file as it reads then;
with ``--watch-config`` each worker sees the file change by itself. Every
wait is for a log line or an answer, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
from conftest import RedisServer
from support import Lines
from test_workers import Supervisor, http_get, spawned

from trio_failover.core.config import Config, Upstream
from trio_failover.core.errors import ConfigError
from trio_failover.core.workers import worker_reload_config

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")

LIMIT = 60.0


def write_fleet(path: Path, nodes: list[str], **settings: object) -> None:
    """A config file: its listeners on ports 0, ``settings`` at the top, one node per name."""
    settings = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", **settings}
    lines = [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    for port, name in enumerate(nodes, start=9):
        lines += ["[[upstream]]", f'name = "{name}"', f'url = "http://127.0.0.1:{port}"']
    path.write_text("\n".join(lines) + "\n")


def flags(config: Path, redis: RedisServer) -> list[str]:
    """What the tests give ``serve`` (and ``check``, to compare like with like) beyond the file."""
    return [
        f"--config={config}",
        "--workers=2",
        f"--state=redis://127.0.0.1:{redis.port}",
        "--discovery-interval=0",
        "--shutdown-timeout=2s",
    ]


@asynccontextmanager
async def workers(config: Path, redis: RedisServer) -> AsyncIterator[Supervisor]:
    command = [sys.executable, "-m", "trio_failover", "serve", *flags(config, redis)]
    async with spawned(command, drain=True) as sup:
        yield sup


async def wait_count(lines: Lines, text: str, count: int, after: int) -> list[str]:
    """The first ``count`` lines with ``text`` from line ``after`` on (bound it)."""
    found: list[str] = []
    while len(found) < count:
        line = await lines.wait_for(text, after)
        found.append(line)
        after = lines.index(line, after) + 1
    return found


async def node_names(admin: tuple[str, int]) -> list[str]:
    answer = await http_get(admin, "/status")
    status = json.loads(answer.partition(b"\r\n\r\n")[2])
    return [node["name"] for node in status["nodes"]]


async def check_admin(
    config: Path, redis: RedisServer, admin: tuple[str, int]
) -> subprocess.CompletedProcess[bytes]:
    command = [sys.executable, "-m", "trio_failover", "check", *flags(config, redis)]
    command += [f"--admin=http://{admin[0]}:{admin[1]}"]
    return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)


async def test_sighup_reloads_every_worker_and_a_restarted_one_keeps_the_reload(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = tmp_path / "fleet.toml"
    write_fleet(config, ["a"])
    with trio.fail_after(LIMIT):
        async with workers(config, redis_server) as sup:
            admin = await sup.address("admin")
            first = await sup.worker_pid(0)
            await sup.worker_pid(1)
            assert await node_names(admin) == ["a"]

            write_fleet(config, ["a", "b"])
            seen = len(sup.lines)
            sup.process.send_signal(signal.SIGHUP)
            await sup.lines.wait_for("SIGHUP: reloading the workers", seen)
            reloaded = await wait_count(sup.lines, "reloaded", 2, seen)
            assert all("node b added" in line for line in reloaded)
            assert await node_names(admin) == ["a", "b"]
            # check --admin asks the first worker, which says the file's settings.
            asked = await check_admin(config, redis_server, admin)
            assert asked.stdout.decode().rstrip().endswith("would change nothing"), asked.stdout

            # The worker with the admin listener, killed and started again,
            # serves the fleet of the reload, not that of the program's start.
            seen = len(sup.lines)
            os.kill(first, signal.SIGKILL)
            await sup.worker_pid(0, after=seen)
            assert await node_names(admin) == ["a", "b"]

            # A listener change: refused by every worker, applied by none.
            write_fleet(config, ["a", "b", "c"], listen="127.0.0.1:1")
            seen = len(sup.lines)
            sup.process.send_signal(signal.SIGHUP)
            # Each worker says why once (its error line), then its refusal.
            why = await wait_count(sup.lines, "needs a restart", 2, seen)
            refused = await wait_count(sup.lines, "reload refused", 2, seen)
            assert all("ERROR" in line for line in why), why
            assert all("mistakes=1" in line for line in refused), refused
            assert await node_names(admin) == ["a", "b"]


async def test_a_sighup_while_the_workers_start_ends_none_and_reaches_each(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = tmp_path / "fleet.toml"
    write_fleet(config, ["a"])
    with trio.fail_after(LIMIT):
        async with workers(config, redis_server) as sup:
            await sup.worker_pid(0)  # the supervisor handles signals; worker 1 may be starting
            sup.process.send_signal(signal.SIGHUP)
            await sup.worker_pid(1)
            admin = await sup.address("admin")
            await wait_count(sup.lines, "reloaded", 2, 0)
            assert await node_names(admin) == ["a"]
            assert not any("worker exited" in line for line in sup.lines)


async def test_watch_config_reloads_every_worker(tmp_path: Path, redis_server: RedisServer) -> None:
    config = tmp_path / "fleet.toml"
    write_fleet(config, ["a"], watch_config=True)
    with trio.fail_after(LIMIT):
        async with workers(config, redis_server) as sup:
            admin = await sup.address("admin")
            await sup.worker_pid(1)
            seen = len(sup.lines)
            write_fleet(config, ["a", "b"], watch_config=True)
            reloaded = await wait_count(sup.lines, "reloaded", 2, seen)
            assert all("node b added" in line for line in reloaded)
            assert await node_names(admin) == ["a", "b"]


# -- the pure decision ----------------------------------------------------------------------


def test_a_worker_reload_is_its_worker_config_or_refuses_a_listener_change() -> None:
    nodes = [Upstream("a", "http://127.0.0.1:9")]
    program = Config(upstreams=nodes, listen="127.0.0.1:0", admin_listen="127.0.0.1:0")
    new = attrs.evolve(program, max_queue=7)
    first = worker_reload_config(program, new, 0)
    assert (first.listen, first.admin_listen, first.max_queue) == ("127.0.0.1:0", "127.0.0.1:0", 7)
    other = worker_reload_config(program, new, 1)
    assert (other.admin_listen, other.max_queue) == (None, 7)
    # The admin listener turned off: refused by the second worker too, which has none.
    off = attrs.evolve(program, admin_listen=None)
    for index in (0, 1):
        with pytest.raises(ConfigError, match="admin-listen"):
            worker_reload_config(program, off, index)
