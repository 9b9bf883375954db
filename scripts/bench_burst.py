"""Burst benchmark: a load spike against a fleet of engines with a few slots each.

    make bench                      # runs this after bench.py
    .venv/bin/python scripts/bench_burst.py --requests 200 --nodes 4 --slots 4 --service-ms 100

Starts ``--nodes`` fake engines on 127.0.0.1, each serving at most
``--slots`` requests at once and queueing the rest inside itself (as
llama-server with ``--parallel`` or Ollama with ``OLLAMA_NUM_PARALLEL``
do), each request taking ``--service-ms``. Then sends ``--requests``
requests at once through the proxy, run as a real subprocess
(``trio-failover serve``), three times: with ``--capacity`` equal to the
engines' slots; with no ``--capacity`` at all (``auto``, issue 30), the
engines then being fake llama-servers (``trio_failover.testing``'s
``FakeLlamaServer``) that say their slots in ``GET /props`` and
``GET /slots``, the burst starting once ``/status`` shows every node's
capacity read from its engine, and the engines read every
``--load-interval`` (250 ms, so that several readings land within the
burst); and with ``--capacity 0`` (no limit, the
proxy's behaviour without issue 17). It prints the makespan (first request
sent to last answer read) against the ideal, requests x service time /
total slots, and how many requests each node served. ``--runs`` picks some
of the three (``slots,auto,0``).

Without capacity every request goes to the first node, which works through
them ``--slots`` at a time; with it the proxy fills every node's slots and
holds the rest in its queue. The goal is a makespan within 1.15x of ideal,
with a configured capacity and with ``auto`` alike.

A measurement tool, not a test: it asserts nothing, and exits 0 unless
something could not be started.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import h11
import trio
import trio.testing

from trio_failover.testing import (
    FakeLlamaServer,
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    read_response,
    request_tcp,
)

BODY = b'{"model":"bench","messages":[{"role":"user","content":"burst"}],"stream":false}'
GOAL = 1.15


def engine(slots: int, service: float) -> FakeNode:
    """A fake engine: ``slots`` requests at once, the rest wait inside it."""
    limiter = trio.CapacityLimiter(slots)

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        async with limiter:
            await trio.sleep(service)
        body = b'{"ok": true}'
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await io.send(
            h11.Response(status_code=200, headers=head), h11.Data(data=body), h11.EndOfMessage()
        )

    return FakeNode(behave)


def llama_server(slots: int, service: float) -> FakeNode:
    """A fake llama-server ``--parallel slots``: its ``/props`` and ``/slots`` say so."""
    return FakeNode(FakeLlamaServer(slots=slots, model="bench", tokens=1, token_delay=service))


async def start_proxy(
    nursery: trio.Nursery, upstreams: list[str], capacity: int | None, load_interval: str
) -> tuple[trio.Process, tuple[str, int], tuple[str, int] | None]:
    """``trio-failover serve`` in a subprocess; it, its client and admin addresses.

    ``capacity`` None gives no ``--capacity`` (``auto``), ``load_interval``
    and an admin listener, to see when the engines' slots are known.
    """
    command = [
        sys.executable,
        "-m",
        "trio_failover",
        "serve",
        "--listen=127.0.0.1:0",
        "--admin-listen=" + ("off" if capacity is not None else "127.0.0.1:0"),
        "--log-level=info",  # the "listening on" line is at info
        *([f"--load-interval={load_interval}"] if capacity is None else [f"--capacity={capacity}"]),
        *(f"--upstream={upstream}" for upstream in upstreams),
    ]
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert process.stderr is not None
    stderr = process.stderr
    buffer = b""
    lines = [b"listening on http://"] + ([b"admin on http://"] if capacity is None else [])
    with trio.fail_after(20):
        while not all(b"\n" in buffer.partition(line)[2] for line in lines):
            chunk = await stderr.receive_some(65536)
            if not chunk:
                raise RuntimeError(f"the proxy exited: {buffer.decode(errors='replace')}")
            buffer += chunk
    client, *admin = (address_after(buffer, line) for line in lines)

    async def drain_stderr() -> None:  # a full pipe would block the proxy's logging
        while await stderr.receive_some(65536):
            pass

    nursery.start_soon(drain_stderr)
    return process, client, admin[0] if admin else None


def address_after(log: bytes, line: bytes) -> tuple[str, int]:
    """The ``host:port`` that follows ``line`` in the proxy's log."""
    text = log.split(line, 1)[1].split(b"\n", 1)[0].decode()
    host, _, port = text.split()[0].rpartition(":")
    return host, int(port)


async def wait_auto_capacity(admin: tuple[str, int], nodes: int, slots: int) -> float:
    """Until ``/status`` shows every node's capacity read from its engine; seconds it took."""
    began = trio.current_time()
    with trio.fail_after(30):
        while True:
            answer = await request_tcp(admin, "GET", "/status")
            found = json.loads(answer.body)["nodes"] if answer and answer.status == 200 else []
            known = [node for node in found if node["capacity"] == slots]
            if len(known) == nodes:
                return trio.current_time() - began
            await trio.sleep(0.05)


async def burst(address: tuple[str, int], requests: int) -> tuple[float, Counter[str], int]:
    """Send ``requests`` at once; the makespan, requests per serving node, failures.

    The client connections are opened first and the clock starts when every
    request is ready to go: the makespan measures the proxy's scheduling,
    not this script's TCP handshakes.
    """
    served: Counter[str] = Counter()
    failures = 0
    go = trio.Event()
    host, port = address
    head = [
        (b"host", f"{host}:{port}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(BODY)),
    ]

    async def one(stream: trio.SocketStream) -> None:
        nonlocal failures
        conn = h11.Connection(h11.CLIENT)
        data = b"".join(
            conn.send(event) or b""
            for event in (
                h11.Request(method="POST", target="/v1/chat/completions", headers=head),
                h11.Data(data=BODY),
                h11.EndOfMessage(),
            )
        )
        try:
            await go.wait()
            await stream.send_all(data)
            response = await read_response(stream, conn)
        finally:
            await trio.aclose_forcefully(stream)
        if response.status != 200:
            failures += 1
            return
        served[response.header("x-failover-node") or "?"] += 1

    with trio.fail_after(600):
        streams = [await trio.open_tcp_stream(host, port) for _ in range(requests)]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(one, stream)
            await trio.testing.wait_all_tasks_blocked()
            began = trio.current_time()
            go.set()
    return trio.current_time() - began, served, failures


RUNS = ("slots", "auto", "0")


async def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The runs of ``args.runs``; results by the ``--capacity`` each ran with."""
    service = args.service_ms / 1000
    names = [f"n{index}" for index in range(1, args.nodes + 1)]
    results: dict[str, dict[str, Any]] = {}
    for label in args.runs:
        capacity = {"slots": args.slots, "auto": None, "0": 0}[label]
        make = llama_server if capacity is None else engine
        # Fresh engines per run: nothing left queued inside them from before.
        nodes = {name: make(args.slots, service) for name in names}
        async with Fleet(nodes) as fleet, trio.open_nursery() as nursery:
            upstreams = [await fleet.serve_tcp(name) for name in names]
            process, address, admin = await start_proxy(
                nursery, [f"{u.name}={u.url}" for u in upstreams], capacity, args.load_interval
            )
            try:
                if admin is not None:
                    await wait_auto_capacity(admin, args.nodes, args.slots)
                cpu_before = cpu_seconds(process.pid)
                makespan, served, failures = await burst(address, args.requests)
                cpu = cpu_seconds(process.pid) - cpu_before
            finally:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
            nursery.cancel_scope.cancel()
        results["auto" if capacity is None else str(capacity)] = {
            "makespan": makespan,
            "served": served,
            "failures": failures,
            "cpu": cpu,
        }
    return results


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux /proc; else 0)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # Fields 14 and 15 of proc(5), utime and stime, counted after the ")".
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> list[str]:
    """The lines to print."""
    ideal = args.requests * (args.service_ms / 1000) / (args.nodes * args.slots)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"burst: {args.requests} requests at once, {args.nodes} nodes x {args.slots} slots, "
        f"{args.service_ms:g} ms each; ideal makespan {ideal:.3f} s "
        f"(load average {load:.2f}, {os.cpu_count()} CPUs)",
    ]
    for capacity, result in results.items():
        ratio = result["makespan"] / ideal
        spread = " ".join(f"{node}={count}" for node, count in sorted(result["served"].items()))
        verdict = ""
        if capacity != "0":
            verdict = f"  (goal <= {GOAL:.2f}x: {'met' if ratio <= GOAL else 'missed'})"
        lines.append(
            f"  --capacity {capacity:<4} makespan {result['makespan']:.3f} s  "
            f"{ratio:.2f}x ideal  proxy CPU {result['cpu'] * 1e6 / args.requests:.0f} us/req  "
            f"served {spread}  failed {result['failures']}{verdict}"
        )
    return lines


def runs(value: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in value.split(",") if part.strip())
    if not chosen or any(part not in RUNS for part in chosen):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma-separated list of {', '.join(RUNS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4, help="per node, and the proxy's capacity")
    parser.add_argument("--service-ms", type=float, default=100.0)
    parser.add_argument(
        "--runs",
        type=runs,
        default=RUNS,
        help="which runs, comma-separated: slots (--capacity = --slots), auto (no --capacity, "
        "fake llama-servers), 0 (no limit); default all three",
    )
    parser.add_argument(
        "--load-interval",
        default="250ms",
        help="the run auto's --load-interval: short, so that readings land within the burst, "
        "each showing every slot busy (the proxy's default is 2s)",
    )
    args = parser.parse_args(argv)
    results = trio.run(run, args)
    for line in report(args, results):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
