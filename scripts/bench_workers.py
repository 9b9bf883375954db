"""``--workers 2`` against one worker, and ``--state redis://`` against ``memory`` (issue 31).

    make bench                                   # runs this after bench.py
    .venv/bin/python scripts/bench_workers.py [--rounds 2] [--only streams,cpu]

Starts its own ``redis-server`` on a free 127.0.0.1 port (nothing saved),
bench_stream.py's streaming upstream and bench.py's JSON upstream, and
measures, round after round so that a busy machine weighs on every system
alike:

- ``streams``: N endless SSE streams (an event every 100 ms each, as in
  bench.py's streaming part) through ``direct`` (no proxy: the ceiling of
  the load generators themselves), ``1 worker`` and ``2 workers``, both
  with ``--state redis://`` (``--workers 2`` needs a shared state; one
  worker gets the same, so only the worker count differs). N climbs the
  ladder until the p99 delay of a chunk passes 25 ms; the result is the
  largest N within it, with the proxy's CPU per relayed chunk (every
  process of it: supervisor and workers) and the share of a core the
  load generators took.
- ``cpu``: small JSON requests one after another on one keep-alive
  connection, through one proxy with ``--state memory`` and one with
  ``--state redis://``, alternated; the proxy's CPU (user plus system, from
  /proc) per request, and the difference. The issue's bound: at most
  0.1 ms more with Redis.

The load generators share the machine's cores with the proxy: they are
bench_stream.c's epoll loops (``--generators``: compiled with ``cc``, or
bench_stream.py's ``selectors`` loops where there is none; the first line
says which), about 7 to 13 us of CPU per chunk, and the ``direct`` rows
say where they run out themselves; a fleet that reaches
that ceiling is reported as ``>=``. The CPU per chunk, beside the streams,
does not depend on how many cores were free: a 2-worker fleet whose CPU
per chunk is the single worker's scales with the cores it is given.

Prints ``uptime``'s load averages before each round: other work on the
machine lowers every figure. A measurement tool: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import bench
import bench_redis
import bench_stream

P99_MS = bench.TARGET_STREAM_P99_MS
LADDER = (200, 300, 400, 500, 600, 800, 1000, 1200, 1400, 1700, 2000, 2500, 3000)
SYSTEMS = ("direct", "1 worker", "2 workers")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@contextlib.contextmanager
def fleet(
    workdir: Path, upstream: str, workers: int, state: str, capacity: int = 0
) -> Iterator[tuple[int, int]]:
    """``trio-failover serve --workers N``; yields (port, supervisor pid) once it serves.

    ``capacity`` above 0: ``--capacity``, so that with a shared state every
    attempt takes and releases its slot's lease in Redis.
    """
    port = bench.free_port()
    command = [sys.executable, "-m", "trio_failover", "serve", "--listen", f"127.0.0.1:{port}"]
    command += ["--admin-listen", "127.0.0.1:0", "--upstream", upstream, "--state", state]
    command += ["--workers", str(workers), "--max-connections", "8000"]
    command += ["--discovery-interval", "0"]
    if capacity:
        command += ["--capacity", str(capacity)]
    log_path = workdir / f"proxy-{port}.log"
    with (
        log_path.open("wb") as log,
        bench.started(command, stdout=log, stderr=log, cwd=bench.ROOT) as process,
    ):
        deadline = time.monotonic() + 60
        while True:  # every worker accepts: the supervisor logs "listening on" then
            text = log_path.read_text(errors="replace")
            if "listening on" in text:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"trio-failover did not start:\n{text[-2000:]}")
            time.sleep(0.1)
        yield port, process.pid


# -- streams at a p99 bound ------------------------------------------------------------


@dataclass
class Ladder:
    """One system's climb in one round."""

    steps: list[bench.StreamStep] = field(default_factory=list)

    @property
    def best(self) -> bench.StreamStep | None:
        ok = [step for step in self.steps if step.ok]
        return max(ok, key=lambda step: step.streams) if ok else None


def climb(args: argparse.Namespace, port: int, pid: int | None, upstream_pid: int) -> Ladder:
    ladder = Ladder()
    bench.stream_step(port, pid, upstream_pid, 10, None, 0.3, 0.5)  # warm-up
    for streams in args.ladder:
        for attempt in range(1 + args.retries):  # other work on the machine comes in bursts
            before = process_cpu(pid)
            step = bench.stream_step(
                port, pid, upstream_pid, streams, None, args.warmup, args.duration
            )
            again = "" if attempt == 0 else " (again)"
            row = bench.stream_row("", step, None).strip()
            print(f"  {row}{split(before, process_cpu(pid))}{again}", flush=True)
            if step.ok:
                break
        ladder.steps.append(step)
        if not step.ok:
            break
    return ladder


def process_cpu(pid: int | None) -> dict[int, float]:
    """CPU seconds so far of each process of a system (the supervisor and its workers)."""
    if pid is None:
        return {}
    return {p: bench.cpu_seconds(p) or 0.0 for p in bench.process_tree(pid)}


def split(before: dict[int, float], after: dict[int, float]) -> str:
    """How a step's CPU went over the processes (workers by pid order): whether the
    kernel spread the connections over the workers' sockets."""
    spent = [after[p] - before[p] for p in sorted(after) if p in before]
    total = sum(spent)
    if len(spent) < 3 or total <= 0:  # a single proxy, or no reading
        return ""
    return "  split " + "/".join(f"{100 * cpu / total:.0f}" for cpu in spent) + "%"


def run_streams(args: argparse.Namespace, workdir: Path, state: str) -> dict[str, list[Ladder]]:
    results: dict[str, list[Ladder]] = {name: [] for name in SYSTEMS if name in args.systems}
    with bench.child_stream_upstream() as (upstream_port, upstream_pid):
        upstream = f"stream=http://127.0.0.1:{upstream_port}"
        for round_ in range(1, args.rounds + 1):
            print(f"streams, round {round_}: load average {load_average()}", flush=True)
            print("  streams chunks/s p50 ms p99 ms max ms CPU us/chunk ... upstream clients")
            for name in results:
                print(f" {name}", flush=True)
                if name == "direct":
                    results[name].append(climb(args, upstream_port, None, upstream_pid))
                    continue
                with fleet(workdir, upstream, int(name[0]), state) as (port, pid):
                    results[name].append(climb(args, port, pid, upstream_pid))
    return results


def streams_summary(results: dict[str, list[Ladder]]) -> None:
    print(f"\nstreams within p99 <= {P99_MS:g} ms, by round (CPU us per chunk at that N):")
    direct = results.get("direct", [])
    ceiling = [ladder.best.streams if ladder.best else 0 for ladder in direct]
    for name in results:
        cells = []
        for index, ladder in enumerate(results[name]):
            best = ladder.best
            if best is None:
                cells.append("none")
                continue
            capped = name != "direct" and bool(ceiling) and best.streams >= ceiling[index]
            cpu = f" ({best.cpu_us:.0f} us)" if best.cpu_us else ""
            cells.append(f"{'>=' if capped else ''}{best.streams}{cpu}")
        print(f"  {name:10s} " + ", ".join(cells))
    if "1 worker" not in results or "2 workers" not in results:
        return
    ratios = []
    for one, two in zip(results["1 worker"], results["2 workers"], strict=True):
        if one.best and two.best:
            ratios.append(two.best.streams / one.best.streams)
    if ratios:
        print("  2 workers / 1 worker: " + ", ".join(f"{r:.2f}x" for r in ratios))
    print("p99 ms at the same N, 1 worker -> 2 workers (the last try of each step):")
    for index, (one, two) in enumerate(zip(results["1 worker"], results["2 workers"], strict=True)):
        theirs = {step.streams: step for step in two.steps}
        pairs = [
            f"{step.streams}: {step.p99_ms:.1f} -> {theirs[step.streams].p99_ms:.1f}"
            for step in one.steps
            if step.streams in theirs
        ]
        print(f"  round {index + 1}: " + ", ".join(pairs))


# -- request-path CPU: redis against memory --------------------------------------------


def cpu_per_request(port: int, pid: int, count: int) -> float:
    """Microseconds of the proxy's CPU per small JSON request, over ``count`` of them."""
    before = bench.tree_cpu(pid) or 0.0
    bench.keepalive_requests(port, count)
    return ((bench.tree_cpu(pid) or 0.0) - before) / count * 1e6


def run_cpu(args: argparse.Namespace, workdir: Path, redis: str, capacity: int) -> None:
    """Both proxies run at once; blocks of requests go to each in turn, the first one alternating.

    /proc counts CPU in ticks of 10 ms: a block of 3,000 requests reads to
    about 3 us a request, and taking turns block by block lets a change in
    the machine's load weigh on both.
    """
    figures: dict[str, list[float]] = {"memory": [], "redis": []}
    with contextlib.ExitStack() as stack:
        json_port, _ = stack.enter_context(bench.child("upstream"))[0]
        upstream = f"json=http://127.0.0.1:{json_port}"
        proxies = {
            # A capacity puts the slot's lease on the path: with one request
            # at a time and one replica nobody else wants the slot, so an
            # ended attempt's lease is kept for the next, at any capacity
            # (docs/replicas.md, "Spare leases").
            name: stack.enter_context(fleet(workdir, upstream, 1, state, capacity=capacity))
            for name, state in (("memory", "memory"), ("redis", redis))
        }
        for port, _ in proxies.values():
            bench.keepalive_requests(port, 500)  # warm-up: the pool, the first imports
        print(f"cpu: load average {load_average()}", flush=True)
        for turn in range(args.rounds * 3):
            order = ("memory", "redis") if turn % 2 == 0 else ("redis", "memory")
            for name in order:
                figures[name].append(cpu_per_request(*proxies[name], args.requests))
            row = "  ".join(f"{name} {figures[name][-1]:6.1f}" for name in order)
            print(f"  block {turn + 1}: {row} us/request", flush=True)
    memory, redis_cpu = statistics.median(figures["memory"]), statistics.median(figures["redis"])
    print(
        f"\nrequest-path CPU, median of {len(figures['memory'])} blocks of {args.requests}: "
        f"memory {memory:.1f} us, redis {redis_cpu:.1f} us, "
        f"difference {redis_cpu - memory:+.1f} us (bound: +100 us; --capacity {capacity}); "
        f"load average {load_average()}"
    )


def numbers(text: str) -> tuple[int, ...]:
    """An option's ``N,N,...``."""
    return tuple(int(n) for n in text.split(","))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each part (default 2)")
    parser.add_argument("--only", default="streams,cpu", help="parts: streams,cpu (default both)")
    parser.add_argument(
        "--ladder",
        type=numbers,
        default=LADDER,
        metavar="N,N,...",
        help=f"stream counts to climb (default {','.join(map(str, LADDER))})",
    )
    parser.add_argument("--duration", type=float, default=2.0, help="seconds measured per step")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each step")
    parser.add_argument(
        "--retries", type=int, default=1, help="times a step over the bound is tried again"
    )
    parser.add_argument("--requests", type=int, default=3000, help="JSON requests per cpu row")
    parser.add_argument(
        "--capacity",
        type=numbers,
        default=(1, 8),
        metavar="N,N,...",
        help="the node's --capacity in the cpu part, one run each (default 1,8)",
    )
    parser.add_argument(
        "--systems",
        type=lambda text: tuple(text.split(",")),
        default=SYSTEMS,
        metavar="NAME,...",
        help=f"the streams part's systems, of {','.join(SYSTEMS)} (default all)",
    )
    bench_stream.add_generators_argument(parser)
    args = parser.parse_args()
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"--systems: {', '.join(sorted(unknown))} is not one of {', '.join(SYSTEMS)}")
    bench.raise_fd_limit()
    if "streams" in args.only.split(","):
        print(bench_stream.choose(args.generators), flush=True)
    parts = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as directory:
        server, redis_port = bench_redis.start_server(directory)
        try:
            redis = f"redis://127.0.0.1:{redis_port}"
            print(f"redis-server on 127.0.0.1:{redis_port}; load average {load_average()}")
            if "streams" in parts:
                streams_summary(run_streams(args, Path(directory), redis))
            if "cpu" in parts:
                for capacity in args.capacity:
                    run_cpu(args, Path(directory), redis, capacity)
        finally:
            server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
