"""CPU and wall time per Redis command under Trio: coredis, our client, and by hand.

    .venv/bin/pip install coredis          # for the comparison only
    .venv/bin/python scripts/bench_redis.py [--commands 1000] [--rounds 5]

Starts its own ``redis-server`` on a free 127.0.0.1 port (Debian's
package; nothing is saved) and times ``--commands`` sequential ``INCR``
from one Trio task, three ways, taking turns round after round so that a
busy machine weighs on all of them alike:

- ``coredis``: coredis (runs on Trio through anyio), one client, awaited
  command by command; skipped with a note when it is not installed;
- ``wire.redis``: trio_failover's own connection (hiredis' packer and C
  parser, a deadline per command, as the proxy will call it);
- ``by hand``: RESP written to a bare Trio socket and read with hiredis, no
  deadline, no checks: the floor under any client on Trio.

Plus ``wire.redis x16``: the same commands from 16 tasks sharing one
connection (their commands pipeline on the socket).

CPU is this process's user plus system time (``time.process_time``), so
the server's share is not counted. Prints the median per command of each
and its ratio to ``by hand``. A measurement tool: it asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import hiredis
import trio

from trio_failover.core.redis_url import RedisAddress
from trio_failover.wire.redis import open_redis

Timed = Callable[[int, int], Awaitable[None]]


def start_server(directory: str) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server on a free port, answering; retried if the port was taken meanwhile."""
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("redis-server is not on PATH (apt-get install -y redis-server)")
    for _ in range(5):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        process = subprocess.Popen(
            [
                server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                directory,
            ],
            stdout=subprocess.PIPE,
        )
        assert process.stdout is not None
        for line in process.stdout:  # ends when the server exits (the port was taken)
            if b"Ready to accept connections" in line:
                return process, port
        process.wait()
    sys.exit("redis-server did not start")


async def by_hand(port: int, count: int) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    reader = hiredis.Reader()
    command = hiredis.pack_command((b"INCR", b"hand"))
    for _ in range(count):
        await stream.send_all(command)
        while reader.gets() is False:
            reader.feed(await stream.receive_some(65536))
    await stream.aclose()


async def ours(port: int, count: int) -> None:
    address = RedisAddress(host="127.0.0.1", port=port)
    async with await open_redis(address, deadline=trio.current_time() + 5) as connection:
        for _ in range(count):
            await connection.execute("INCR", "ours", deadline=trio.current_time() + 1)


async def ours_shared(port: int, count: int, tasks: int = 16) -> None:
    address = RedisAddress(host="127.0.0.1", port=port)
    async with await open_redis(address, deadline=trio.current_time() + 5) as connection:

        async def worker(share: int) -> None:
            for _ in range(share):
                await connection.execute("INCR", "shared", deadline=trio.current_time() + 1)

        async with trio.open_nursery() as nursery:
            for index in range(tasks):
                nursery.start_soon(worker, count // tasks + (index < count % tasks))


async def with_coredis(port: int, count: int) -> None:
    import coredis  # optional: only for this comparison

    async with coredis.Redis(host="127.0.0.1", port=port) as client:
        for _ in range(count):
            await client.incr("coredis")


async def measure(port: int, rounds: int, count: int) -> dict[str, list[tuple[float, float]]]:
    ways: dict[str, Timed] = {"by hand": by_hand, "wire.redis": ours, "wire.redis x16": ours_shared}
    if importlib.util.find_spec("coredis") is not None:
        ways["coredis"] = with_coredis
    else:
        print("coredis is not installed: pip install coredis to compare with it")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            await run(port, 10)  # connect and warm up outside the timing
            cpu, wall = time.process_time(), time.perf_counter()
            await run(port, count)
            results[name].append(
                ((time.process_time() - cpu) / count, (time.perf_counter() - wall) / count)
            )
    return results


def report(results: dict[str, list[tuple[float, float]]], count: int, rounds: int) -> None:
    print(f"{count} INCR per round, {rounds} rounds, median per command (and range of rounds)")
    floor = statistics.median(cpu for cpu, _ in results["by hand"])
    print(f"{'client':<16} {'CPU':>9} {'range':>17} {'wall':>9} {'CPU / by hand':>14}")
    for name, rows in results.items():
        cpus = [cpu for cpu, _ in rows]
        cpu, wall = statistics.median(cpus), statistics.median(w for _, w in rows)
        span = f"{min(cpus) * 1e6:.0f}-{max(cpus) * 1e6:.0f} us"
        ratio = f"{cpu / floor:.1f}x"
        print(f"{name:<16} {cpu * 1e6:>6.0f} us {span:>17} {wall * 1e6:>6.0f} us {ratio:>14}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--commands", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        server, port = start_server(directory)
        try:
            results = trio.run(measure, port, args.rounds, args.commands)
        finally:
            server.terminate()
            server.wait(10)
    print(f"load average: {Path('/proc/loadavg').read_text().split()[0]}")
    report(results, args.commands, args.rounds)


if __name__ == "__main__":
    main()
