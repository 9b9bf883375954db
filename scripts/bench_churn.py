"""Churn benchmark: new streams under load, trio-failover against the bare relay (issue 33).

    make bench                                  # bench.py runs this part too
    .venv/bin/python scripts/bench.py --only churn
    .venv/bin/python scripts/bench_churn.py --churn-ladder 500,1000 --churn-rounds 2

Per N of ``--churn-ladder``, two scenarios, each through the bare Trio + h11
relay (``bench.py relay``) and through ``trio-failover serve``, the two
alternated within the run (relay first for one N, the proxy first for the
next) so that both see the same host:

- **churn**: N concurrent SSE streams of ``--churn-chunks`` events (one every
  100 ms, from ``bench_stream.py``'s upstream), a new stream on a new
  connection as soon as one ends; after ``--churn-warmup`` s, measured for
  ``--churn-duration`` s;
- **burst**: N new streams at once from idle, each run to its end.

Figures per row (from ``bench_churn_clients.py``): first byte (connect to
first event) p50/p99/max, the connect's own p99 (a SYN dropped by a full
accept queue shows there, as a second or more), chunk gap p99 (between two
events of a stream, as read; 100 ms nominal), delivered chunks/s, streams
lost, and the kernel's listen-queue counters (``/proc/net/netstat``:
``ListenOverflows``, ``ListenDrops``, ``TCPSynRetrans``; for the whole host)
over the row. ``--churn-pin`` puts the relay or proxy on CPU 0 and the load
generators on CPU 1; by default all share both cores, as on a small box.

At the end it prints issue 33's goals with met / NOT met: at 500 and 1,000
streams of churn, first-byte p99 <= 1.5 x the relay's, delivered chunks/s
>= 0.95 x the relay's, no stream lost (over several rounds, the median
ratio). A measurement tool: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:  # also when loaded by path (the tests)
    sys.path.insert(0, str(SCRIPTS))
import bench_stream  # noqa: E402  (beside this script, not a package)

CHURN_LADDER = (250, 500, 1000, 2000)
GOAL_NS = (500, 1000)
GOAL_FIRST_BYTE_RATIO = 1.5
GOAL_CHUNK_RATIO = 0.95
SYSTEMS = ("bare relay", "trio-failover")
COUNTERS = ("ListenOverflows", "ListenDrops", "TCPSynRetrans")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The churn part's options (shared by bench.py and this script)."""
    parser.add_argument(
        "--churn-ladder",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=CHURN_LADDER,
        metavar="N,N,...",
        help=f"concurrent streams per churn row (default: {','.join(map(str, CHURN_LADDER))})",
    )
    parser.add_argument(
        "--churn-rounds", type=int, default=1, help="times each N is measured (default 1)"
    )
    parser.add_argument(
        "--churn-warmup", type=float, default=4.0, help="seconds before the window (default 4)"
    )
    parser.add_argument(
        "--churn-duration", type=float, default=5.0, help="seconds measured (default 5)"
    )
    parser.add_argument(
        "--churn-chunks", type=int, default=40, help="events per stream (default 40)"
    )
    parser.add_argument(
        "--churn-pin",
        action="store_true",
        help="relay/proxy on CPU 0, upstream and clients on CPU 1",
    )
    parser.add_argument(
        "--churn-baseline",
        metavar="DIR",
        action="append",
        default=[],
        help="also run the trio_failover package found in DIR (another checkout), "
        "alternated with the others, as 'baseline' (repeat: each as its directory's name)",
    )
    bench_stream.add_generators_argument(parser)
    parser.add_argument(
        "--churn-scenarios",
        default="churn,burst",
        help="comma-separated: churn, burst (default both)",
    )


# -- processes ---------------------------------------------------------------------------


@contextlib.contextmanager
def started(command: list[str], **kwargs: object) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(command, **kwargs)  # type: ignore[call-overload]
    with process:
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_fd_limit() -> int:
    """Raise this process's descriptor limit (children inherit it); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    return max(soft, wanted)


def pin(pid: int, cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > cpu:
        os.sched_setaffinity(pid, {cpu})


def kernel_counters() -> dict[str, int]:
    """The host's TcpExt counters named in COUNTERS (Linux; else empty)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return {}
    values: dict[str, int] = {}
    for names, numbers in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], numbers.split()[1:], strict=False))
            values = {name: int(row.get(name, 0)) for name in COUNTERS}
    return values


@dataclass
class System:
    name: str
    port: int
    pid: int


@contextlib.contextmanager
def proxy_system(
    name: str, workdir: Path, upstream_port: int, top: int, proxy_args: list[str], tree: Path
) -> Iterator[System]:
    """``trio-failover serve`` of the package in ``tree``, in front of the upstream."""
    port = free_port()
    command = [
        *(sys.executable, "-m", "trio_failover", "serve"),
        *("--listen", f"127.0.0.1:{port}", "--admin-listen", "off"),
        *("--upstream", f"stream=http://127.0.0.1:{upstream_port}"),
        *("--max-connections", str(2 * top + 100)),
        *proxy_args,
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    log_path = workdir / f"churn-{name}.log"
    with (
        log_path.open("wb") as log,
        started(command, stdout=log, stderr=log, cwd=tree, env=env) as process,
    ):
        try:
            wait_port(port)
        except OSError:
            sys.exit(f"trio-failover did not start:\n{log_path.read_text()[-2000:]}")
        yield System(name, port, process.pid)


def baselines(args: argparse.Namespace) -> dict[str, Path]:
    """The other checkouts to run (``--churn-baseline``), by the name their rows carry."""
    dirs = [Path(path).resolve() for path in args.churn_baseline]
    if len(dirs) == 1:
        return {"baseline": dirs[0]}
    return {path.name[:14]: path for path in dirs}


@contextlib.contextmanager
def systems(
    args: argparse.Namespace, workdir: Path, upstream_port: int, top: int, proxy_args: list[str]
) -> Iterator[dict[str, System]]:
    """The bare relay and trio-failover (and the baseline), in front of the upstream."""
    relay_command = [sys.executable, str(SCRIPTS / "bench.py"), "relay", str(upstream_port)]
    trees = {SYSTEMS[1]: ROOT}
    trees.update(baselines(args))
    with contextlib.ExitStack() as stack:
        relay = stack.enter_context(started(relay_command, stdout=subprocess.PIPE))
        assert relay.stdout is not None
        running = {SYSTEMS[0]: System(SYSTEMS[0], int(relay.stdout.readline()), relay.pid)}
        for name, tree in trees.items():
            running[name] = stack.enter_context(
                proxy_system(name, workdir, upstream_port, top, proxy_args, tree)
            )
        for system in running.values():
            pin(system.pid, 0 if args.churn_pin else None)
        yield running


# -- one row -------------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    streams: int
    system: str
    fields: dict[str, float] = field(default_factory=dict)
    cpu: float = 0.0  # the system's share of one core over the row
    counters: dict[str, int] = field(default_factory=dict)
    load: float = 0.0

    def get(self, key: str) -> float:
        return self.fields.get(key, float("nan"))

    @property
    def rate(self) -> float:
        seconds = self.get("seconds")
        return self.get("chunks") / seconds if seconds else 0.0

    @property
    def lost(self) -> int:
        return int(self.get("lost") + self.fields.get("unfinished", 0))


def parse(line: str) -> dict[str, float]:
    return {key: float(value) for key, value in (item.split("=") for item in line.split())}


def measure(
    args: argparse.Namespace, scenario: str, n: int, system: System, cpu: int | None
) -> Row:
    """One row: the client process through ``system``, the counters around it."""
    command = [
        sys.executable,
        str(SCRIPTS / "bench_churn_clients.py"),
        *(str(system.port), str(n), str(args.churn_chunks)),
    ]
    row = Row(scenario, n, system.name, load=os.getloadavg()[0])
    counters = kernel_counters()
    with started(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as clients:
        assert clients.stdin is not None
        assert clients.stdout is not None
        pin(clients.pid, cpu)
        clients.stdin.write(f"{scenario}\n".encode())
        clients.stdin.flush()
        if scenario == "churn":
            time.sleep(args.churn_warmup)
        before, began = cpu_seconds(system.pid), time.monotonic()
        if scenario == "churn":
            clients.stdin.write(b"go\n")
            clients.stdin.flush()
            time.sleep(args.churn_duration)
            clients.stdin.write(b"stop\n")
            clients.stdin.flush()
        line = clients.stdout.readline().decode()
        row.cpu = (cpu_seconds(system.pid) - before) / max(time.monotonic() - began, 1e-9)
    after = kernel_counters()
    row.counters = {name: after[name] - counters.get(name, 0) for name in after}
    row.fields = parse(line) if line.strip() else {}
    time.sleep(1.0)  # the last connections close before the next row
    return row


# -- the report ----------------------------------------------------------------------------

HEADER = (
    "scenario streams system         chunks/s  x relay  first byte p50    p99    max  x relay"
    "  connect p99  gap p99  lost  CPU   overflows/drops/SYN-retrans  load"
)


def ratio(value: float, reference: float) -> float:
    return value / reference if reference and reference == reference else float("nan")


def row_line(row: Row, relay: Row | None) -> str:
    rate_ratio = ratio(row.rate, relay.rate) if relay and relay is not row else 1.0
    first_ratio = (
        ratio(row.get("first_p99"), relay.get("first_p99")) if relay and relay is not row else 1.0
    )
    counters = "/".join(str(row.counters.get(name, "?")) for name in COUNTERS)
    waiting = int(row.get("waiting")) if row.fields else 0
    notes = f"  ({waiting} still waiting)" if waiting else ""
    return (
        f"{row.scenario:8s} {row.streams:7d} {row.system:14s} {row.rate:9.0f}  {rate_ratio:6.2f}"
        f"  {row.get('first_p50'):14.0f} {row.get('first_p99'):6.0f} {row.get('first_max'):6.0f}"
        f"  {first_ratio:6.2f}  {row.get('connect_p99'):11.1f}  {row.get('gap_p99'):7.0f}"
        f"  {row.lost:4d} {row.cpu * 100:3.0f}%  {counters:>27s}  {row.load:4.2f}" + notes
    )


def goals(rows: list[Row], system: str = SYSTEMS[1]) -> list[tuple[str, str, bool]]:
    """Issue 33's goals from the churn rows at GOAL_NS: (name, measured, met)."""
    results = []
    prefix = "" if system == SYSTEMS[1] else f"{system}: "
    for n in GOAL_NS:
        pairs = pairs_at(rows, "churn", n, system)
        if not pairs:
            results.append(
                (
                    f"{prefix}churn {n}: first-byte p99 <= {GOAL_FIRST_BYTE_RATIO} x bare relay",
                    "not measured",
                    False,
                )
            )
            continue
        first = statistics.median(ratio(p.get("first_p99"), r.get("first_p99")) for r, p in pairs)
        rate = statistics.median(ratio(p.rate, r.rate) for r, p in pairs)
        lost = sum(p.lost for _, p in pairs)
        rounds = f" (median of {len(pairs)})" if len(pairs) > 1 else ""
        results += [
            (
                f"{prefix}churn {n}: first-byte p99 <= {GOAL_FIRST_BYTE_RATIO} x bare relay",
                f"{first:.2f} x{rounds}",
                first <= GOAL_FIRST_BYTE_RATIO,
            ),
            (
                f"{prefix}churn {n}: delivered chunks/s >= {GOAL_CHUNK_RATIO} x bare relay",
                f"{rate:.2f} x{rounds}",
                rate >= GOAL_CHUNK_RATIO,
            ),
            (f"{prefix}churn {n}: no stream lost", f"{lost} lost", lost == 0),
        ]
    return results


def pairs_at(
    rows: list[Row], scenario: str, n: int, system: str = SYSTEMS[1]
) -> list[tuple[Row, Row]]:
    """(relay, ``system``) rows of one scenario and N, round by round."""
    relay = [r for r in rows if (r.scenario, r.streams, r.system) == (scenario, n, SYSTEMS[0])]
    other = [r for r in rows if (r.scenario, r.streams, r.system) == (scenario, n, system)]
    return list(zip(relay, other, strict=False))


def run_churn(
    args: argparse.Namespace,
    out: Callable[[str], None],
    proxy_args: list[str],
) -> list[tuple[str, str, bool]]:
    """Every row, printed as it comes; returns the goals."""
    wanted = raise_fd_limit()
    ladder = [n for n in args.churn_ladder if 2 * n + 200 <= wanted]
    scenarios = args.churn_scenarios.split(",")
    load_cpu = 1 if args.churn_pin else None
    out(
        f"Churn (issue 33): N streams of {args.churn_chunks} events, 100 ms apart, each replaced "
        f"on a new connection when it ends ({args.churn_warmup:g} s settling, "
        f"{args.churn_duration:g} s measured), and a burst of N at once from idle; "
        f"{'relay/proxy on CPU 0, generators on CPU 1' if args.churn_pin else 'all on every CPU'}"
        f"; first byte in ms from connect; proxy flags: {' '.join(proxy_args) or '(defaults)'}"
    )
    out(HEADER)
    rows: list[Row] = []
    upstream_command = bench_stream.command("upstream")
    with (
        tempfile.TemporaryDirectory(prefix="trio-failover-churn-") as tmp,
        started(upstream_command, stdout=subprocess.PIPE) as upstream,
    ):
        assert upstream.stdout is not None
        upstream_port = int(upstream.stdout.readline())
        pin(upstream.pid, load_cpu)
        top = max(ladder, default=1)
        with systems(args, Path(tmp), upstream_port, top, proxy_args) as running:
            names = list(running)
            step = 0
            for _ in range(args.churn_rounds):
                for n in ladder:
                    for scenario in scenarios:
                        # Each system in turn, the order rotated from step to
                        # step: none is always measured first or last.
                        order = names[step % len(names) :] + names[: step % len(names)]
                        step += 1
                        group = {
                            name: measure(args, scenario, n, running[name], load_cpu)
                            for name in order
                        }
                        rows += group.values()
                        for name in names:
                            out(row_line(group[name], group[SYSTEMS[0]]))
    return goals(rows) + [goal for name in baselines(args) for goal in goals(rows, name)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    add_arguments(parser)
    parser.add_argument(
        "--proxy-arg", action="append", default=[], metavar="FLAG", help="for serve (repeat)"
    )
    args = parser.parse_args(argv)
    print(
        f"churn benchmark, {time.strftime('%Y-%m-%d %H:%M')}; load average "
        f"{os.getloadavg()[0]:.2f} at start, {os.cpu_count()} CPUs",
        flush=True,
    )
    print(bench_stream.choose(args.generators), flush=True)
    results = run_churn(args, lambda line: print(line, flush=True), args.proxy_arg)
    print(f"Goals of issue 33 (load average {os.getloadavg()[0]:.2f} at the end)")
    for name, measured, met in results:
        print(f"  {'met' if met else 'NOT met':8s} {name}: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
