"""Where a new stream waits: per-stage timestamps of trio-failover or the bare relay.

    .venv/bin/python scripts/bench_stages.py proxy 500     # or: relay 500
    .venv/bin/python scripts/bench_stages.py relay 1000 --scenario burst
    .venv/bin/python scripts/bench_stages.py proxy 500 --steps   # where each pass's CPU went

Runs ``bench_churn.py``'s churn (or burst) scenario against one system run
*in this script's child process* with its functions wrapped to stamp each
stage of each connection on CLOCK_MONOTONIC (the clock the client's times
use), keyed by the client's port; the client writes its own times
(``BENCH_CHURN_TRACE``), and the two are joined. A debugging tool for the
benchmark only: the wrappers cost what they cost, and they reach into
private names of the package (``server._handle``, ``upstream._connect``...),
so a refactoring may need them adjusted. The package itself carries no
instrumentation.

Stages, each printed as the time since the previous one present, and as
the passes of the system's run loop (Trio's I/O checks, noted by an
instrument) begun meanwhile, which do not depend on how busy the host is:

- proxy: client connected (the kernel's handshake) -> accepted (taken from
  the backlog) -> task (the connection's
  handler runs) -> read (first bytes read) -> head (request parsed) ->
  pool_ask -> pooled or connected (a node connection) -> request ->
  nodehead (the node's head) -> first (first write to the client) ->
  client_first (the client read the first event);
- relay: connected -> accepted -> task -> connected (its node connection,
  opened first) -> read -> request -> nodehead -> first -> client_first.

With ``--steps``, an instrument also takes each task step's CPU time and
sums it per pass by kind (a connection's steps before its first byte, its
relay steps after it, other tasks, the garbage collector), for all passes
and the longest ones, and the report adds the accept loop's batch sizes
and every collection of the collector (its CPU time and what it freed).
The proxy is served as ``run_server`` serves it (``tune_collector`` where
the package has it); set ``PYTHONPATH`` to another checkout to measure it.
"""

from __future__ import annotations

import argparse
import bisect
import contextvars
import importlib
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import bench_churn  # noqa: E402

PROXY_STAGES = [
    "accepted",
    "task",
    "read",
    "head",
    "pool_ask",
    "pooled",
    "pool_miss",
    "connected",
    "request",
    "nodehead",
    "first",
]
RELAY_STAGES = ["accepted", "task", "connected", "read", "request", "nodehead", "first"]

STAMPS: dict[int, dict[str, int]] = {}
CURRENT: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("stage")
PASSES: list[int] = []  # when each pass of Trio's run loop began (its I/O check)


class PassClock:
    """A Trio instrument noting the time of every pass of the run loop."""

    def before_io_wait(self, timeout: float) -> None:
        PASSES.append(time.monotonic_ns())


# Per pass of the run loop (with --steps): its start and end (wall clock),
# and the CPU ns its task steps took, by kind: a connection's steps before
# its first write to the client ("new"), after it ("relay"), other tasks',
# and the collector's (within the steps); the steps of each kind; the tasks
# spawned.
STEPS: list[list[int]] = []
BATCHES: list[tuple[int, int]] = []  # (when, connections) of each turn of the accept loop
# (when, generation, ns, CPU ns, objects freed) of each collection
COLLECTIONS: list[tuple[int, int, int, int, int]] = []
KINDS = ("new", "relay", "other", "gc", "new_steps", "relay_steps", "spawned")


class StepClock:
    """A Trio instrument timing each task step, summed per pass by kind."""

    def __init__(self) -> None:
        self.current = [0] * (2 + len(KINDS))
        self.began = 0
        self.gc_began = 0
        self.gc_cpu = 0

    def after_io_wait(self, timeout: float) -> None:
        self.current = [time.monotonic_ns(), 0] + [0] * len(KINDS)

    def before_io_wait(self, timeout: float) -> None:
        self.current[1] = time.monotonic_ns()
        STEPS.append(self.current)

    def task_spawned(self, task: Any) -> None:
        self.current[8] += 1

    def before_task_step(self, task: Any) -> None:
        self.began = time.thread_time_ns()

    def after_task_step(self, task: Any) -> None:
        spent = time.thread_time_ns() - self.began  # CPU: what a busy host does not inflate
        stamps = task.context.get(CURRENT, None)
        if stamps is None:
            self.current[4] += spent
        elif "first" in stamps and stamps.get("first_seen"):
            self.current[3] += spent
            self.current[7] += 1
        else:
            if "first" in stamps:
                stamps["first_seen"] = 1
            self.current[2] += spent
            self.current[6] += 1

    def collected(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.gc_began, self.gc_cpu = time.monotonic_ns(), time.thread_time_ns()
        else:
            spent = time.monotonic_ns() - self.gc_began
            cpu = time.thread_time_ns() - self.gc_cpu
            self.current[5] += cpu
            COLLECTIONS.append((self.gc_began, info["generation"], spent, cpu, info["collected"]))


def count_passes() -> None:
    """Start noting passes (from inside the run, once)."""
    import gc

    import trio

    if not PASSES:
        PASSES.append(time.monotonic_ns())
        trio.lowlevel.add_instrument(PassClock())  # type: ignore[arg-type]
        if os.environ.get("BENCH_STAGES_STEPS"):
            clock = StepClock()
            trio.lowlevel.add_instrument(clock)  # type: ignore[arg-type]
            gc.callbacks.append(clock.collected)


def mark(name: str) -> None:
    stamps = CURRENT.get(None)
    if stamps is not None and name not in stamps:
        stamps[name] = time.monotonic_ns()


def own(stream: Any) -> bool:
    """Whether ``stream`` is the current connection's client socket."""
    stamps = CURRENT.get(None)
    sock = getattr(stream, "socket", None)
    return stamps is not None and sock is not None and sock.fileno() == stamps.get("fd")


def wrap_accept() -> None:
    import trio

    accept = trio.SocketListener.accept

    async def stamped(self: trio.SocketListener) -> trio.SocketStream:
        stream = await accept(self)
        STAMPS[stream.socket.getpeername()[1]] = {"accepted": time.monotonic_ns()}
        return stream

    trio.SocketListener.accept = stamped  # type: ignore[method-assign]


def begin(stream: Any) -> None:
    """The connection's task starts: its stamps become the context's."""
    count_passes()
    port = stream.socket.getpeername()[1]
    stamps = STAMPS.get(port)
    if stamps is None or "task" in stamps:  # a new connection from a reused port
        stamps = STAMPS[port] = {}
    stamps["task"], stamps["fd"] = time.monotonic_ns(), stream.socket.fileno()
    CURRENT.set(stamps)


def after(owner: Any, name: str, stage: str) -> None:
    """Wrap async ``owner.name`` to mark ``stage`` when it returns."""
    real = getattr(owner, name)

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)
        mark(stage)
        return result

    setattr(owner, name, wrapped)


def serve_proxy(port: int, upstream_port: int) -> None:
    import trio

    from trio_failover.core.config import Config, Upstream
    from trio_failover.service import server
    from trio_failover.wire import client, http1, pool, upstream

    # The socket reads and writes: http1's, or before issue 41 a module of their own.
    socket_io: Any = (
        http1
        if hasattr(http1, "write_now")
        else importlib.import_module("trio_failover.wire.socket_io")
    )

    wrap_accept()
    handle = server._handle

    async def stamped_handle(stream: trio.SocketStream, *args: Any) -> None:
        begin(stream)
        await handle(stream, *args)

    server._handle = stamped_handle  # type: ignore[assignment]
    pending = getattr(server, "accept_pending", None)  # absent before issue 33's fix
    if pending is not None:

        def stamped_pending(listener: Any, limiter: Any, start: Any, most: int) -> int:
            def stamped_start(stream: trio.SocketStream, token: object) -> None:
                STAMPS[stream.socket.getpeername()[1]] = {"accepted": time.monotonic_ns()}
                start(stream, token)

            taken = int(pending(listener, limiter, stamped_start, most))
            BATCHES.append((time.monotonic_ns(), taken + 1))  # with the awaited accept's
            return taken

        server.accept_pending = stamped_pending
    receive, write_now, send = socket_io.receive, socket_io.write_now, socket_io.send
    read_now = getattr(socket_io, "read_now", None)  # absent before the first read without a wait
    if read_now is not None:

        def stamped_read_now(stream: Any, size: int = socket_io.RECEIVE_SIZE) -> bytes | None:
            data = read_now(stream, size)
            if data and own(stream):
                mark("read")
            return data

        socket_io.read_now = stamped_read_now

    async def stamped_receive(stream: Any, size: int = socket_io.RECEIVE_SIZE) -> bytes:
        data = await receive(stream, size)
        if own(stream):
            mark("read")
        return data

    def stamped_write_now(stream: Any, data: bytes) -> int:
        written = write_now(stream, data)
        if own(stream):
            mark("first")
        return written

    async def stamped_send(stream: Any, data: bytes) -> None:
        await send(stream, data)
        if own(stream):
            mark("first")

    socket_io.receive, socket_io.write_now, socket_io.send = (
        stamped_receive,
        stamped_write_now,
        stamped_send,
    )
    after(client.ClientConnection, "read_request", "head")
    acquire = pool.ConnectionPool.acquire

    async def stamped_acquire(self: Any, *args: Any, **kwargs: Any) -> Any:
        mark("pool_ask")
        idle = await acquire(self, *args, **kwargs)
        mark("pooled" if idle else "pool_miss")
        return idle

    pool.ConnectionPool.acquire = stamped_acquire  # type: ignore[method-assign]
    after(upstream, "_connect", "connected")
    request_and_head = upstream._request_and_head

    async def stamped_request_and_head(*args: Any, **kwargs: Any) -> Any:
        mark("request")
        result = await request_and_head(*args, **kwargs)
        mark("nodehead")
        return result

    upstream._request_and_head = stamped_request_and_head  # type: ignore[assignment]
    config = Config(
        upstreams=[Upstream("stream", f"http://127.0.0.1:{upstream_port}")],
        listen=f"127.0.0.1:{port}",
        admin_listen=None,
        max_connections=8192,
    )

    tune = getattr(server, "tune_collector", None)  # as run_server does (absent before)
    if tune is not None:
        tune()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, config)
            print(port, flush=True)

    trio.run(main)


def serve_relay(upstream_port: int) -> None:
    import bench
    import trio
    import trio._highlevel_serve_listeners as serving

    wrap_accept()
    run_handler = serving._run_handler

    async def stamped_run_handler(stream: Any, handler: Any) -> None:
        begin(stream)
        await run_handler(stream, handler)

    serving._run_handler = stamped_run_handler
    after(trio, "open_tcp_stream", "connected")
    receive_some, send_all = trio.SocketStream.receive_some, trio.SocketStream.send_all

    async def stamped_receive(self: trio.SocketStream, size: int | None = None) -> bytes:
        data = await receive_some(self, size)
        mark("read" if own(self) else "nodehead")
        return bytes(data)

    async def stamped_send(self: trio.SocketStream, data: Any) -> None:
        await send_all(self, data)
        mark("first" if own(self) else "request")

    trio.SocketStream.receive_some = stamped_receive  # type: ignore[method-assign]
    trio.SocketStream.send_all = stamped_send  # type: ignore[method-assign]
    bench.run_relay(upstream_port)


def quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


def report(system: str, dumped: dict[str, Any], trace: Path) -> None:
    stages = PROXY_STAGES if system == "proxy" else RELAY_STAGES
    stamps: dict[str, dict[str, int]] = dumped["stamps"]
    passes: list[int] = dumped["passes"]
    deltas: dict[str, list[int]] = {}
    counts: dict[str, list[int]] = {}  # passes of the run loop begun in each stage
    for line in trace.read_text().splitlines():
        port, began, connected, first = (int(field) for field in line.split())
        own_stamps = stamps.get(str(port))
        # Ports are reused: only the connection that ran within this stream.
        if own_stamps is None or not began <= own_stamps.get("task", 0) <= first:
            continue
        sequence = [("start", began), ("client connected", connected)]
        sequence += [(name, own_stamps[name]) for name in stages if name in own_stamps]
        sequence.append(("client_first", first))
        for (_, earlier), (name, later) in itertools.pairwise(sequence):
            deltas.setdefault(name, []).append(later - earlier)
            crossed = bisect.bisect(passes, later) - bisect.bisect(passes, earlier)
            counts.setdefault(name, []).append(crossed)
    cpu = stamps.get("0", {}).get("cpu_us", 0) / 1e6
    streams = len(deltas.get("client_first", []))
    print(f"{system}: ms since the previous stage, over {streams} streams ({cpu:.2f} s of CPU)")
    for name in ["client connected", *stages, "client_first"]:
        values = deltas.get(name)
        if values:
            crossed = [count * 1_000_000 for count in counts[name]]  # quantile() divides
            print(
                f"  {name:17s} n={len(values):5d}  p50 {quantile(values, 0.5):8.1f}  "
                f"p90 {quantile(values, 0.9):8.1f}  p99 {quantile(values, 0.99):8.1f}  "
                f"max {quantile(values, 1.0):8.1f}   passes p50 {quantile(crossed, 0.5):4.0f}"
                f"  p99 {quantile(crossed, 0.99):4.0f}"
            )
    window_start = min((int(line.split()[1]) for line in trace.read_text().splitlines()), default=0)
    report_steps([p for p in dumped.get("steps", []) if p[0] >= window_start])
    batches = sorted(n for when, n in dumped.get("batches", []) if when >= window_start)
    if batches:
        print(
            f"  accept loop turns in the window: {len(batches)}, connections per turn p50 "
            f"{batches[len(batches) // 2]}, p99 {batches[int(len(batches) * 0.99)]}, "
            f"max {batches[-1]}; over 16: {sum(n > 16 for n in batches)}"
        )
    collections = dumped.get("gc", [])
    if collections:
        whole = (collections[-1][0] - collections[0][0]) / 1e9
        objects = stamps.get("1", {})
        print(
            f"  collections over the run ({whole:.1f} s; at the end {objects.get('objects')} "
            f"objects, {objects.get('gen2')} in the oldest generation):"
        )
    for generation in range(3):
        spans = [c[2] for c in collections if c[1] == generation]
        cpu = [c[3] for c in collections if c[1] == generation]
        if spans:
            print(
                f"    generation {generation}: {len(spans)}, p50 {quantile(spans, 0.5):.2f} ms, "
                f"max {quantile(spans, 1.0):.2f} ms; CPU p50 {quantile(cpu, 0.5):.2f} ms, "
                f"max {quantile(cpu, 1.0):.2f} ms, total {sum(cpu) / 1e6:.0f} ms; objects freed "
                f"{sum(c[4] for c in collections if c[1] == generation)}"
            )
    gaps = [later - earlier for earlier, later in itertools.pairwise(passes[1:])]
    if gaps:
        print(
            f"  passes of the run loop: {len(gaps) + 1}, each p50 {quantile(gaps, 0.5):.1f} ms,"
            f" p99 {quantile(gaps, 0.99):.1f} ms"
        )


def report_steps(steps: list[list[int]]) -> None:
    """Where the passes' time went (with --steps): by kind, overall and in the longest."""
    if not steps:
        return
    durations = sorted(steps, key=lambda p: p[1] - p[0])
    span = (steps[-1][1] - steps[0][0]) / 1e9
    header = "  ".join(f"{k:>8s}" for k in ("pass ms", *KINDS))

    def line(name: str, chosen: list[list[int]]) -> str:
        count = max(len(chosen), 1)
        mean = [sum(p[1] - p[0] for p in chosen) / count / 1e6]
        mean += [
            sum(p[2 + i] for p in chosen) / count / (1e6 if i < 4 else 1) for i in range(len(KINDS))
        ]
        return f"  {name:22s}" + "  ".join(f"{v:8.2f}" for v in mean)

    print(
        f"  passes in the window: {len(steps)} over {span:.1f} s; mean per pass "
        "(pass: wall ms; kinds: CPU ms; steps):"
    )
    print(f"  {'':22s}{header}")
    print(line("all passes", steps))
    for share in (0.5, 0.1, 0.01):
        top = durations[int(len(durations) * (1 - share)) :]
        print(line(f"longest {share:.0%}", top))
    totals = [sum(p[2 + i] for p in steps) / 1e9 / span for i in range(4)]
    print(
        "  CPU of the window by kind, as a share of one core: "
        + ", ".join(f"{k} {t:.0%}" for k, t in zip(KINDS, totals, strict=False))
    )


def dump_on_term(path: str) -> None:
    import gc

    def dump(*_: object) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        STAMPS[0] = {"cpu_us": int((usage.ru_utime + usage.ru_stime) * 1e6)}
        STAMPS[1] = {"objects": len(gc.get_objects()), "gen2": len(gc.get_objects(2))}

        Path(path).write_text(
            json.dumps(
                {
                    "stamps": STAMPS,
                    "passes": PASSES,
                    "steps": STEPS,
                    "gc": COLLECTIONS,
                    "batches": BATCHES,
                }
            )
        )
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("system", choices=["proxy", "relay", "serve-proxy", "serve-relay"])
    parser.add_argument("streams", type=int)
    parser.add_argument("--scenario", choices=["churn", "burst"], default="churn")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument(
        "--steps", action="store_true", help="also time every task step, per pass, by kind"
    )
    parser.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system.startswith("serve-"):
        dump_on_term(args.out)
        if args.system == "serve-proxy":
            serve_proxy(bench_churn.free_port(), args.upstream_port)
        else:
            serve_relay(args.upstream_port)
        return 0
    bench_churn.raise_fd_limit()
    upstream_command = [sys.executable, str(SCRIPTS / "bench_stream.py"), "upstream"]
    with (
        tempfile.TemporaryDirectory(prefix="trio-failover-stages-") as tmp,
        bench_churn.started(upstream_command, stdout=subprocess.PIPE) as upstream,
    ):
        assert upstream.stdout is not None
        upstream_port = int(upstream.stdout.readline())
        stamps_path, trace = Path(tmp) / "stamps.json", Path(tmp) / "trace.txt"
        command = [
            *(sys.executable, __file__, f"serve-{args.system}", "0"),
            *("--upstream-port", str(upstream_port), "--out", str(stamps_path)),
        ]
        served_env = {**os.environ, "BENCH_STAGES_STEPS": "1" if args.steps else ""}
        with bench_churn.started(command, stdout=subprocess.PIPE, env=served_env) as system:
            assert system.stdout is not None
            port = int(system.stdout.readline())
            clients = [
                *(sys.executable, str(SCRIPTS / "bench_churn_clients.py")),
                *(str(port), str(args.streams), str(args.chunks)),
            ]
            env = {**os.environ, "BENCH_CHURN_TRACE": str(trace)}
            with bench_churn.started(
                clients, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            ) as load:
                assert load.stdin is not None
                assert load.stdout is not None
                load.stdin.write(f"{args.scenario}\n".encode())
                load.stdin.flush()
                if args.scenario == "churn":
                    for line, pause in ((b"go\n", 4.0), (b"stop\n", 5.0)):
                        time.sleep(pause)
                        load.stdin.write(line)
                        load.stdin.flush()
                print(load.stdout.readline().decode().strip())
            system.send_signal(signal.SIGTERM)
            system.wait(30)
        report(args.system, json.loads(stamps_path.read_text()), trace)

    return 0


if __name__ == "__main__":
    sys.exit(main())
