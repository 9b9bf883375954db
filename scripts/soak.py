"""Soak the proxy: many requests through faulty nodes, then look for leaks.

    .venv/bin/python scripts/soak.py                                  # 5000 requests, 64 clients
    .venv/bin/python scripts/soak.py --requests 20000 --concurrency 128 --seed 7

Runs ``trio-failover serve`` as a subprocess in front of three fake nodes
served by this script on 127.0.0.1, and drives it with concurrent keep-alive
clients. Nodes ``a`` and ``b`` misbehave at random before commit (they
stall, close, reset, send a head and close, or answer 503); node ``c``
never does, so every request can be served and a lost response is the
proxy's fault. Clients abort some requests at random (FIN or RST, before the
answer or mid-stream). Every other response must arrive whole, with the
exact body its request asked for. The nodes answer the proxy's own ``GET``
questions (discovery, ``/health``) without faults: ``200`` on ``/health``,
an empty model list on ``/v1/models``, ``404`` elsewhere.

The nodes close a keep-alive connection idle for ``--node-keepalive``
(2 s), as uvicorn does after 5 s; the proxy's pool keeps idle connections
for up to ``--pool-idle-timeout`` (4 s, the default), so after a burst it is
the nodes that close first, and the proxy must notice.

It reports requests OK / aborted / failed, and the proxy's RSS and open file
descriptors (from ``/proc``) at startup, after a warm-up (the baseline) and
after the run. Both times no request is sent afterwards: the script waits
for the nodes to close their idle connections, then measures how long the
proxy took to get back to its startup descriptor count (+2). It exits 1
on any lost response (a request not aborted that did not get a full,
correct body), when the descriptors are not back at startup + 2 within a
second of the last node close, on RSS growth over 10 MB, or when the proxy
does not exit 0 on SIGTERM at the end.

This is a measurement, not a unit test (Linux only: it reads ``/proc``).
docs/reliability.md has the figures of a run and how to read them.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h11
import trio

FD_MARGIN = 2
FD_SETTLE = 1.0  # seconds after the last node close for the proxy to close its side
RSS_GROWTH_LIMIT = 10 * 1024 * 1024
REQUEST_TIMEOUT = 30.0
RESPONSE_HEADER_TIMEOUT = 1.0  # short, so a run stays short
# The soak's requests are unstreamed (no "stream": true), so a stalled node
# is waited for up to --unstreamed-timeout (10 min by default), not the
# header timeout (an unstreamed answer's head comes only when the whole
# answer is ready; a liveness check would not cut it either, as
# the stalled node's /health answers). Left at 10 min, every stall outlived
# the client's REQUEST_TIMEOUT and counted as a lost response.
UNSTREAMED_TIMEOUT = 2.0  # what a stall costs
FAULTS = ("stall", "close", "reset", "head_then_close", "status_503")
NODES = ("a", "b", "c")
FAULTY = ("a", "b")
# SO_LINGER on with a zero timeout: close() then sends an RST, not a FIN.
RESET_ON_CLOSE = struct.pack("ii", 1, 0)


# -- what a request asks for, and what its answer must be -------------------------------------


@dataclass(frozen=True)
class Spec:
    """A request's instructions to the node: its whole answer follows from them."""

    id: str
    chunks: int
    size: int
    chunked: bool
    delay: float
    faults: bool = True

    def body(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    def chunk(self, index: int) -> bytes:
        prefix = f"{self.id}:{index}:".encode()
        return prefix + b"x" * max(0, self.size - len(prefix) - 1) + b"\n"

    def answer(self) -> bytes:
        return b"".join(self.chunk(i) for i in range(self.chunks))


def random_spec(rng: random.Random, name: str) -> Spec:
    return Spec(
        id=name,
        chunks=rng.randint(1, 8),
        size=rng.choice([16, 200, 4000]),
        chunked=rng.random() < 0.5,
        delay=rng.choice([0.0, 0.0, 0.002, 0.01]),
    )


# -- the fake nodes -------------------------------------------------------------------------


@dataclass
class Fleet:
    rng: random.Random
    fault_rate: float
    keepalive: float  # a node closes a connection idle this long
    injected: collections.Counter[str] = field(default_factory=collections.Counter)
    served: collections.Counter[str] = field(default_factory=collections.Counter)
    checks: collections.Counter[str] = field(default_factory=collections.Counter)  # by path
    open: int = 0
    last_close: float = 0.0
    closed: trio.Event = field(default_factory=trio.Event)

    def fault_for(self, node: str, spec: Spec) -> str | None:
        if node not in FAULTY or not spec.faults or self.rng.random() >= self.fault_rate:
            return None
        fault = self.rng.choice(FAULTS)
        self.injected[fault] += 1
        return fault

    async def serve_connection(self, node: str, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        self.open += 1
        try:
            while True:
                with trio.move_on_after(self.keepalive) as idle:
                    request = await read_request(stream, conn)
                if idle.cancelled_caught or request is None:
                    return  # idle too long (the node's keep-alive), or the proxy left
                head, body = request
                if head.method != b"POST":
                    # The proxy's own questions (discovery, liveness): no
                    # spec in them, never a fault.
                    self.checks[head.target.decode("ascii", "replace")] += 1
                    await answer_check(stream, conn, head.target)
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
                    continue
                spec = Spec(**json.loads(body))
                fault = self.fault_for(node, spec)
                if fault == "stall":
                    # Never answer; the proxy gives up after its header timeout.
                    with trio.move_on_after(REQUEST_TIMEOUT * 2):
                        while await stream.receive_some(65536):
                            pass
                    return
                if fault == "close":
                    return
                if fault == "reset":
                    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
                    return
                if fault == "head_then_close":
                    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
                    return
                if fault == "status_503":
                    body = b'{"error": {"message": "busy", "code": "overloaded"}}'
                    headers = [
                        ("content-type", "application/json"),
                        ("content-length", str(len(body))),
                    ]
                    await send(stream, conn, h11.Response(status_code=503, headers=headers))
                    await send(stream, conn, h11.Data(data=body), h11.EndOfMessage())
                else:
                    await answer(stream, conn, spec)
                    self.served[node] += 1
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass
        finally:
            await trio.aclose_forcefully(stream)
            self.open -= 1
            self.last_close = trio.current_time()
            self.closed.set()
            self.closed = trio.Event()


async def send(stream: trio.abc.Stream, conn: h11.Connection, *events: h11.Event) -> None:
    await stream.send_all(b"".join(conn.send(event) or b"" for event in events))


async def read_request(
    stream: trio.abc.Stream, conn: h11.Connection
) -> tuple[h11.Request, bytes] | None:
    """One whole request: its head and body (None: the proxy closed the connection)."""
    head: h11.Request | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(65536)))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage) and head is not None:
            return head, body
        else:
            return None


# What a node says to the proxy's checks: ready, with an empty
# model list (inventory unknown: a candidate for every model); any other
# route (/api/tags, an engine's signal routes) is not there.
CHECK_ANSWERS = {
    b"/health": (200, b'{"status": "ok"}'),
    b"/v1/models": (200, b'{"object": "list", "data": []}'),
}
NO_ROUTE = (404, b'{"error": {"message": "not found", "code": "not_found"}}')


async def answer_check(stream: trio.abc.Stream, conn: h11.Connection, target: bytes) -> None:
    status, body = CHECK_ANSWERS.get(target.partition(b"?")[0], NO_ROUTE)
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    await send(
        stream,
        conn,
        h11.Response(status_code=status, headers=headers),
        h11.Data(data=body),
        h11.EndOfMessage(),
    )


async def answer(stream: trio.abc.Stream, conn: h11.Connection, spec: Spec) -> None:
    headers = [("content-type", "text/plain")]
    if not spec.chunked:
        headers.append(("content-length", str(len(spec.answer()))))
    await send(stream, conn, h11.Response(status_code=200, headers=headers))
    for index in range(spec.chunks):
        if index and spec.delay:
            await trio.sleep(spec.delay)
        await send(stream, conn, h11.Data(data=spec.chunk(index)))
    await send(stream, conn, h11.EndOfMessage())


# -- the clients ----------------------------------------------------------------------------


@dataclass
class Tally:
    ok: int = 0
    aborted: int = 0
    failed: int = 0
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)

    def fail(self, spec: Spec, reason: str) -> None:
        self.failed += 1
        self.reasons[reason.split(":")[0]] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{spec.id}: {reason}")


class Client:
    """One keep-alive client connection, reopened after an abort or a close."""

    def __init__(self, address: tuple[str, int], rng: random.Random) -> None:
        self.address = address
        self.rng = rng
        self.stream: trio.SocketStream | None = None
        self.conn = h11.Connection(h11.CLIENT)

    async def open(self) -> trio.SocketStream:
        if self.stream is None:
            self.stream = await trio.open_tcp_stream(*self.address)
            self.conn = h11.Connection(h11.CLIENT)
        return self.stream

    async def close(self, *, reset: bool = False) -> None:
        if self.stream is not None:
            if reset:
                self.stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
            await trio.aclose_forcefully(self.stream)
            self.stream = None

    async def run(
        self,
        spec: Spec,
        tally: Tally,
        *,
        abort: str | None,
        reset: bool,
        extra: list[tuple[str, str]],
    ) -> None:
        try:
            with trio.fail_after(REQUEST_TIMEOUT):
                outcome = await self._exchange(spec, abort=abort, reset=reset, extra=extra)
        except trio.TooSlowError:
            outcome = f"timeout: no full answer in {REQUEST_TIMEOUT} s"
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            outcome = f"connection error: {exc!r}"
        except h11.ProtocolError as exc:
            outcome = f"malformed answer: {exc}"
        if outcome == "ok":
            tally.ok += 1
        elif outcome == "aborted":
            tally.aborted += 1
        else:
            tally.fail(spec, outcome)
            await self.close()

    async def _exchange(
        self, spec: Spec, *, abort: str | None, reset: bool, extra: list[tuple[str, str]]
    ) -> str:
        stream = await self.open()
        conn = self.conn
        body = spec.body()
        headers = [
            ("host", "soak.test"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("x-request-id", spec.id),
            *extra,
        ]
        request = h11.Request(method="POST", target="/v1/chat/completions", headers=headers)
        await stream.send_all(
            conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        )
        if abort == "before_answer":
            await trio.sleep(self.rng.uniform(0, 0.05))
            await self.close(reset=reset)
            return "aborted"
        status = 0
        request_id = None
        received = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data and conn.their_state is not h11.DONE:
                    return f"cut short: {len(received)} body bytes, then the close"
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                request_id = dict(event.headers).get(b"x-request-id")
            elif isinstance(event, h11.Data):
                received += event.data
                if abort == "mid_stream":
                    await self.close(reset=reset)
                    return "aborted"
            elif isinstance(event, h11.EndOfMessage):
                break
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.close()
        if status != 200:
            return f"status {status}: {bytes(received[:200])!r}"
        if request_id != spec.id.encode():
            return f"wrong request id: {request_id!r}"
        if received != spec.answer():
            return f"wrong body: {len(received)} bytes, {spec.chunks * spec.size} expected"
        return "ok"


async def drive(
    address: tuple[str, int],
    rng: random.Random,
    *,
    requests: int,
    concurrency: int,
    abort_rate: float,
    label: str,
) -> Tally:
    """``requests`` requests from ``concurrency`` keep-alive clients."""
    tally = Tally()
    numbers = iter(range(requests))

    async def worker() -> None:
        client = Client(address, rng)
        try:
            for number in numbers:
                spec = random_spec(rng, f"{label}-{number}")
                abort = None
                if rng.random() < abort_rate:
                    abort = rng.choice(["before_answer", "mid_stream"])
                await client.run(spec, tally, abort=abort, reset=rng.random() < 0.5, extra=[])
        finally:
            await client.close()

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return tally


# -- the proxy process ----------------------------------------------------------------------


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Sample:
    fds: int
    rss: int

    @classmethod
    def of(cls, pid: int) -> Sample:
        return cls(fds(pid), rss(pid))


@dataclass
class Settled:
    """The proxy's descriptors once the nodes closed every idle connection."""

    sample: Sample
    after_last_close: float | None  # seconds from the last node close to startup + 2


async def settle(pid: int, fleet: Fleet, target: int | None, limit: float) -> Settled:
    """Send nothing; wait for the nodes to close their idle connections.

    Then, with ``target``, poll the proxy's descriptor count (a kernel fact no
    event reports) until it is at most ``target``, for at most ``limit``
    seconds, and say how long after the last node close it got there.
    """
    with trio.fail_after(fleet.keepalive + REQUEST_TIMEOUT):
        while fleet.open:
            await fleet.closed.wait()
    if target is None:
        await trio.sleep(limit)  # the warm-up: let the proxy close its side
        return Settled(Sample.of(pid), None)
    with trio.move_on_after(limit):
        while fds(pid) > target:  # noqa: ASYNC110 (no event reports it)
            await trio.sleep(0.01)
    reached = trio.current_time() - fleet.last_close
    sample = Sample.of(pid)
    return Settled(sample, reached if sample.fds <= target else None)


def proxy_command(nodes: dict[str, int], pool_idle_timeout: float, extra: list[str]) -> list[str]:
    """The proxy's command line, in front of the nodes on these ports."""
    return [
        sys.executable,
        "-m",
        "trio_failover",
        "serve",
        "--listen=127.0.0.1:0",
        "--admin-listen=off",
        *[f"--upstream={name}=http://127.0.0.1:{port}" for name, port in nodes.items()],
        f"--response-header-timeout={RESPONSE_HEADER_TIMEOUT}s",
        f"--unstreamed-timeout={UNSTREAMED_TIMEOUT}s",
        "--connect-timeout=2s",
        f"--pool-idle-timeout={pool_idle_timeout}s",
        "--shutdown-timeout=10s",
        *extra,
    ]


async def start_proxy(
    nodes: dict[str, int], log: Path, pool_idle_timeout: float, extra: list[str]
) -> tuple[trio.Process, tuple[str, int]]:
    command = proxy_command(nodes, pool_idle_timeout, extra)
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("wb")
    )
    with trio.fail_after(20):
        while True:
            text = await trio.Path(log).read_text(errors="replace")
            for line in text.splitlines():
                if "listening on http://" in line:
                    host, _, port = line.rpartition("http://")[2].rpartition(":")
                    return process, (host, int(port.split()[0]))
            if process.poll() is not None:
                raise RuntimeError(f"the proxy exited at startup:\n{text}")
            await trio.sleep(0.05)


# -- the run --------------------------------------------------------------------------------


@dataclass
class Report:
    args: argparse.Namespace
    warmup: Tally
    run: Tally
    seconds: float
    startup: Sample
    baseline: Sample
    peak_rss: int
    after: Sample
    settled_in: float | None
    exit_status: int | None
    fleet: Fleet
    problems: list[str] = field(default_factory=list)

    def lines(self) -> Iterator[str]:
        mb = 1024 * 1024
        run = self.run
        yield (
            f"soak: {self.args.requests} requests at concurrency {self.args.concurrency}, "
            f"seed {self.args.seed}, node fault rate {self.args.fault_rate:.0%} (a, b), "
            f"client abort rate {self.args.abort_rate:.0%}"
        )
        yield f"  requests   ok {run.ok}   aborted {run.aborted}   failed {run.failed}"
        for reason, count in run.reasons.most_common():
            yield f"    failed: {count} x {reason}"
        for example in run.examples:
            yield f"      e.g. {example}"
        yield (
            f"  time       {self.seconds:.1f} s "
            f"({self.args.requests / self.seconds:.0f} requests/s, "
            f"warm-up of {self.args.warmup} not counted)"
        )
        faults = ", ".join(f"{name} {count}" for name, count in sorted(self.fleet.injected.items()))
        yield f"  faults     {sum(self.fleet.injected.values())} injected: {faults}"
        served = ", ".join(f"{name} {self.fleet.served[name]}" for name in NODES)
        yield f"  served by  {served}"
        checks = ", ".join(f"{path} {count}" for path, count in sorted(self.fleet.checks.items()))
        yield f"  checks     {sum(self.fleet.checks.values())} from the proxy: {checks or 'none'}"
        yield (
            f"  proxy fds  startup {self.startup.fds}, baseline {self.baseline.fds}, "
            f"after {self.after.fds} (limit: startup + {FD_MARGIN})"
        )
        settled = (
            f"{self.settled_in:.2f} s"
            if self.settled_in is not None
            else f"not within {FD_SETTLE:g} s"
        )
        yield (
            f"  idle pool  nodes close idle connections after {self.args.node_keepalive:g} s; "
            f"back at startup + {FD_MARGIN} {settled} after the last node close"
        )
        growth = self.after.rss - self.baseline.rss
        yield (
            f"  proxy RSS  startup {self.startup.rss / mb:.1f} MB, baseline "
            f"{self.baseline.rss / mb:.1f} MB, peak {self.peak_rss / mb:.1f} MB, after "
            f"{self.after.rss / mb:.1f} MB (growth {growth / mb:+.1f} MB, limit "
            f"{RSS_GROWTH_LIMIT / mb:.0f} MB)"
        )
        yield f"  exit       {self.exit_status} after SIGTERM"
        for problem in self.problems:
            yield f"FAIL: {problem}"
        yield "FAIL" if self.problems else "PASS"


async def soak(args: argparse.Namespace, log: Path) -> Report:
    rng = random.Random(args.seed)
    fleet = Fleet(rng, args.fault_rate, args.node_keepalive)
    async with trio.open_nursery() as nursery:
        ports: dict[str, int] = {}
        for name in NODES:
            handler = functools.partial(fleet.serve_connection, name)
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
            )
            ports[name] = listeners[0].socket.getsockname()[1]
        process, address = await start_proxy(ports, log, args.pool_idle_timeout, args.proxy_arg)
        try:
            pid = process.pid
            startup = Sample.of(pid)
            warmup = await drive(
                address,
                rng,
                requests=args.warmup,
                concurrency=args.concurrency,
                abort_rate=args.abort_rate,
                label="warmup",
            )
            baseline = (await settle(pid, fleet, None, FD_SETTLE)).sample
            peak = baseline.rss

            async def watch_rss() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, rss(pid))
                    await trio.sleep(0.25)

            fleet.injected.clear()
            fleet.served.clear()
            async with trio.open_nursery() as watcher:
                watcher.start_soon(watch_rss)
                started = trio.current_time()
                run = await drive(
                    address,
                    rng,
                    requests=args.requests,
                    concurrency=args.concurrency,
                    abort_rate=args.abort_rate,
                    label="soak",
                )
                seconds = trio.current_time() - started
                watcher.cancel_scope.cancel()
            settled = await settle(pid, fleet, startup.fds + FD_MARGIN, FD_SETTLE * 5)
            after = settled.sample
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(15):
                await process.wait()
            exit_status = process.returncode
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        nursery.cancel_scope.cancel()

    settled_in = settled.after_last_close
    report = Report(
        args, warmup, run, seconds, startup, baseline, peak, after, settled_in, exit_status, fleet
    )
    lost = warmup.failed + run.failed
    if lost:
        report.problems.append(f"{lost} lost responses ({warmup.failed} in the warm-up)")
    if settled_in is None or settled_in > FD_SETTLE:
        report.problems.append(
            f"{after.fds} open fds after the run, {startup.fds} at startup: not back at"
            f" startup + {FD_MARGIN} within {FD_SETTLE:g} s of the nodes closing"
        )
    if after.rss - baseline.rss > RSS_GROWTH_LIMIT:
        report.problems.append(f"RSS grew by more than {RSS_GROWTH_LIMIT // 2**20} MB")
    if exit_status != 0:
        report.problems.append(f"the proxy exited with {exit_status} on SIGTERM")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=500, help="requests before the baseline")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-rate", type=float, default=0.1, help="per attempt at a or b")
    parser.add_argument("--abort-rate", type=float, default=0.05, help="per request")
    parser.add_argument(
        "--node-keepalive", type=float, default=2.0, help="seconds before a node closes idle"
    )
    parser.add_argument(
        "--pool-idle-timeout", type=float, default=4.0, help="the proxy's, in seconds"
    )
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="an extra option for the proxy"
    )
    parser.add_argument("--keep-log", action="store_true", help="keep the proxy's log")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("soak.py reads /proc: Linux only", file=sys.stderr)
        return 2
    directory = Path(tempfile.mkdtemp(prefix="trio-failover-soak-"))
    log = directory / "proxy.log"
    report = trio.run(soak, args, log)
    for line in report.lines():
        print(line, flush=True)
    if report.problems or args.keep_log:
        print(f"proxy log: {log}")
    else:
        log.unlink()
        directory.rmdir()
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
