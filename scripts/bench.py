"""Benchmark trio-failover against a direct connection (and nginx) on loopback.

    make bench                      # or: .venv/bin/python scripts/bench.py
    .venv/bin/python scripts/bench.py --duration 2 --only json,memory

Starts a fast upstream and the proxy on 127.0.0.1 and prints, next to going
direct in the same run:

- small JSON requests at 1, 8 and 64 clients: requests/s, p50/p99 latency
  and what the proxy adds to them;
- an SSE stream of 64 chunks written back to back, at 1 and 16 concurrent
  streams (and one stream with 1 ms between chunks): latency per chunk, from
  the upstream's write to the client's read, and what the proxy adds;
- RSS of the proxy process idle and with 1,000 open slow streams;
- failover precision: what a stalled node costs beyond its deadline, and
  what the next request pays while that node cools down;
- streaming: N concurrent endless SSE streams, an event every 100 ms each,
  N climbing 100, 250, 500, ... until the p99 delay of a chunk passes
  25 ms, with each system's CPU per relayed chunk and RSS per open stream
  (load generators in bench_stream.py, processes of their own);
- churn (bench_churn.py): N streams of 40 events replaced on new
  connections as they end, and a burst of N new streams at once, through
  the bare relay and the proxy alternated: the wait for the first byte and
  the chunks delivered (issue 33);
- the slot scheduler (bench_scheduler.py): µs per hand-off of a freed slot
  among 1,000 waiting workloads of 50 clients, first come first served
  against fair share;
- cache affinity: CPU of the proxy per request with a 2 KB and a 100 KB
  chat prompt (20 conversations in turn), ``--affinity prefix`` against
  ``off`` (runs alternated, the median of three);
- with valgrind installed: instructions per small JSON request, and per
  relayed SSE chunk, of the proxy and of the reference relays, counted by
  callgrind, ratios that do not depend on how busy the machine is.

For the proxy and the reference relays, the JSON rows also give the CPU time
(user plus system) that process spent per request, read from /proc on Linux.

Reference rows: ``bare relay`` is a minimal Trio + h11 relay written below
(one upstream keep-alive connection per client connection, no timeouts, no
failover, no logs); ``trio pump`` (JSON part only) is the same without any
HTTP: it copies bytes, which is what Trio alone costs a proxy;
``httptools`` (JSON part only, and only when the httptools package is
installed) is the bare relay with httptools parsing instead of h11;
``nginx`` is nginx as a reverse proxy (one worker, upstream keep-alive, no
access log), when nginx is installed. nginx then also serves the JSON
answers (``return 200``), so the upstream is not the bottleneck; without it
the built-in asyncio upstream does. ``litellm`` (JSON and streaming) is the
LiteLLM proxy, one worker, when ``--litellm`` or the PATH names it.

``wrk`` drives the JSON rows when it is installed; otherwise a built-in
asyncio load generator does, which shares the CPUs with the proxy and gives
lower figures. The SSE, memory, failover and streaming parts always use
built-in clients.

This is a measurement tool, not a test: it asserts nothing, and exits 0
unless something could not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_churn  # noqa: E402  (beside this script, not a package)
import bench_scheduler  # noqa: E402
import bench_stream  # noqa: E402

JSON_REQUEST_BODY = (
    b'{"model":"bench","messages":[{"role":"user","content":"Say ok."}],'
    b'"max_tokens":4,"stream":false}'
)
JSON_ANSWER = (
    b'{"id":"cmpl-bench","object":"chat.completion","model":"bench","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
)
SSE_CHUNKS = 64
SLOW_STREAMS = 1000
CONCURRENCY = (1, 8, 64)
SSE_CONCURRENCY = (1, 16)
SSE_GAP_MS = 1
STALL_DEADLINE_MS = 200

# The targets (see docs/performance.md).
TARGET_REQUEST_CPU_RATIO = 1.25  # issue 22: CPU per request against the bare relay's
TARGET_AFFINITY_CPU_RATIO = 1.20  # issue 43: a 100 KB prompt, affinity on against off
TARGET_CHUNK_P50_MS = 0.5
TARGET_RSS_IDLE_MB = 40
TARGET_RSS_PER_STREAM_KB = 30
TARGET_STALL_EXTRA_MS = 5
TARGET_AFTER_STALL_MS = 1


# -- the upstream (a child process: ``bench.py upstream``) --------------------------


class UpstreamProtocol(asyncio.Protocol):
    """A minimal keep-alive HTTP/1.1 server: canned JSON, SSE bursts, slow streams.

    ``/sse?n=N&gap=MS`` sends N chunked SSE events, each carrying the
    CLOCK_MONOTONIC nanoseconds of its write (system-wide on Linux, so the
    client can subtract), back to back or MS milliseconds apart. ``/slow``
    sends the head and one event, then holds the stream open until the
    client leaves. A ``POST`` to a path ending in ``/completions`` gets a small
    JSON answer; the rest is answered as llama-server does (``bench_stream.route``):
    ``GET /health`` and ``GET /v1/models`` a short JSON answer, anything else
    a 404 at once, the connection closed.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = bytearray()
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            total = end + 4 + (int(match.group(1)) if match else 0)
            if len(self.buffer) < total:
                return
            del self.buffer[:total]
            self.respond(head)
            if self.transport.is_closing():
                return

    def respond(self, head: bytes) -> None:
        write = self.transport.write
        target = head.split(b" ", 2)[1]
        if target.startswith(b"/sse"):
            query = dict(p.split(b"=", 1) for p in target.partition(b"?")[2].split(b"&") if p)
            count, gap = int(query.get(b"n", SSE_CHUNKS)), float(query.get(b"gap", 0)) / 1000
            write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            if gap:
                loop = asyncio.get_running_loop()
                for index in range(count):
                    loop.call_later(index * gap, self.event, index)
                loop.call_later(count * gap, write, b"0\r\n\r\n")
                return
            for index in range(count):
                self.event(index)
            write(b"0\r\n\r\n")
        elif target.startswith(b"/slow"):
            event = b"data: hello\n\n"
            write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
            )
        elif (kind := bench_stream.route(head)) == "stream":  # a completion, not streamed
            write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(JSON_ANSWER), JSON_ANSWER)
            )
        elif kind == "health":
            write(bench_stream.HEALTH_ANSWER)
        elif kind == "models":
            write(bench_stream.MODELS_ANSWER)
        else:
            write(bench_stream.NOT_FOUND_ANSWER)
            self.transport.close()

    def event(self, index: int) -> None:
        if not self.transport.is_closing():
            event = b"data: t=%d;i=%d\n\n" % (time.monotonic_ns(), index)
            self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))


class FrozenProtocol(asyncio.Protocol):
    """Accepts and reads, never answers: a stalled node."""

    def data_received(self, data: bytes) -> None:
        pass


async def run_upstream() -> None:
    loop = asyncio.get_running_loop()
    fast = await loop.create_server(UpstreamProtocol, "127.0.0.1", 0, backlog=4096)
    frozen = await loop.create_server(FrozenProtocol, "127.0.0.1", 0, backlog=4096)
    print(*(s.sockets[0].getsockname()[1] for s in (fast, frozen)), flush=True)
    await asyncio.Event().wait()


# -- reference relays (child processes: ``bench.py relay|pump|httptools PORT``) -------


def run_relay(upstream_port: int, *, socket_io: bool = False) -> None:
    """A bare Trio + h11 relay, the floor any Trio + h11 proxy is measured against.

    ``socket_io``: the same relay reading and writing through the proxy's
    socket reads and writes (``wire.http1``'s ``receive`` and ``send``)
    instead of Trio's stream methods (``relay-io``), to tell what the
    failover work costs on the same I/O.
    """
    import h11
    import trio

    receive: Callable[[Any], Awaitable[bytes]] = lambda stream: stream.receive_some(65536)  # noqa: E731
    send: Callable[[Any, bytes], Awaitable[None]] = lambda stream, data: stream.send_all(data)  # noqa: E731
    if socket_io:
        import importlib

        from trio_failover.wire import http1

        # http1's, or before issue 41 a module of their own.
        io: Any = (
            http1
            if hasattr(http1, "send")
            else importlib.import_module("trio_failover.wire.socket_io")
        )
        receive, send = io.receive, io.send

    async def next_event(stream: trio.SocketStream, conn: h11.Connection) -> object:
        while (event := conn.next_event()) is h11.NEED_DATA:
            conn.receive_data(await receive(stream))
        return event

    async def relay(client: trio.SocketStream, node: trio.SocketStream) -> None:
        down, up = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
        while isinstance(request := await next_event(client, down), h11.Request):
            out = up.send(
                h11.Request(
                    method=request.method, target=request.target, headers=list(request.headers)
                )
            )
            while isinstance(event := await next_event(client, down), h11.Data):
                out += up.send(event)
            await send(node, out + up.send(h11.EndOfMessage()))
            response = await next_event(node, up)
            assert isinstance(response, h11.Response)
            await send(
                client,
                down.send(
                    h11.Response(status_code=response.status_code, headers=list(response.headers))
                ),
            )
            while isinstance(event := await next_event(node, up), h11.Data):
                await send(client, down.send(h11.Data(data=event.data)))
            await send(client, down.send(h11.EndOfMessage()))
            down.start_next_cycle()
            up.start_next_cycle()

    serve_relay(upstream_port, relay, h11.ProtocolError)


def run_pump(upstream_port: int) -> None:
    """Trio with no HTTP at all: what any Trio proxy pays before parsing a byte.

    Per client connection, one upstream connection; each read from the
    client is written upstream, then one read of the answer is written back.
    That is a proxy only for small requests and answers that each arrive in
    one read, as in the JSON part of this benchmark, and only there is it run.
    """
    import trio

    async def pump(client: trio.SocketStream, node: trio.SocketStream) -> None:
        while data := await client.receive_some(65536):
            await node.send_all(data)
            await client.send_all(await node.receive_some(65536))

    serve_relay(upstream_port, pump)


class _Message:
    """What httptools' parser callbacks collect of one message."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def run_httptools_relay(upstream_port: int) -> None:
    """The bare relay with httptools (llhttp, in C) parsing and heads joined by hand.

    Only when httptools is installed (it is not a dependency of the
    project): the floor of a Trio proxy that does not use h11. Like the pump,
    JSON part only: each message is read whole and sent with a Content-Length.
    """
    import httptools  # type: ignore[import-not-found]
    import trio

    framing = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length"}

    def message(start: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        lines = [start]
        lines += [b"%s: %s\r\n" % item for item in headers if item[0].lower() not in framing]
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        return b"".join(lines) + body

    async def read(stream: trio.SocketStream, parser: Any, parsed: _Message) -> bool:
        """Feed ``parser`` until a whole message is in ``parsed``; False at EOF."""
        parsed.reset()
        while not parsed.done:
            if not (data := await stream.receive_some(65536)):
                return False
            parser.feed_data(data)
        return True

    async def relay(client: trio.SocketStream, node: trio.SocketStream) -> None:
        request, response = _Message(), _Message()
        request_parser = httptools.HttpRequestParser(request)
        response_parser = httptools.HttpResponseParser(response)
        while await read(client, request_parser, request):
            start = b"%s %s HTTP/1.1\r\n" % (request_parser.get_method(), request.url)
            await node.send_all(message(start, request.headers, b"".join(request.body)))
            if not await read(node, response_parser, response):
                return
            start = b"HTTP/1.1 %d OK\r\n" % response_parser.get_status_code()
            await client.send_all(message(start, response.headers, b"".join(response.body)))

    serve_relay(upstream_port, relay, httptools.HttpParserError)


def has_httptools() -> bool:
    return importlib.util.find_spec("httptools") is not None


def serve_relay(
    upstream_port: int,
    exchange: Callable[[Any, Any], Awaitable[None]],
    *errors: type[Exception],
) -> None:
    """Serve a reference relay on a free loopback port, printed on the first line.

    Each client connection gets its own connection to the upstream (both
    with ``TCP_NODELAY``), and ``exchange(client, node)`` relays over them
    until it returns or the connection breaks (or raises one of ``errors``).
    """
    import trio

    async def handler(client: trio.SocketStream) -> None:
        client.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        node = await trio.open_tcp_stream("127.0.0.1", upstream_port)
        node.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ended: tuple[type[Exception], ...] = (trio.BrokenResourceError, *errors)
        try:
            await exchange(client, node)
        except ended:
            pass
        finally:
            await trio.aclose_forcefully(node)

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
        print(listeners[0].socket.getsockname()[1], flush=True)
        await trio.serve_listeners(handler, listeners)

    trio.run(main)


# The process helpers are bench_churn's (it is imported by this script, not the other way).
free_port = bench_churn.free_port
started = bench_churn.started


def raise_fd_limit() -> None:
    bench_churn.raise_fd_limit()


def wait_port(port: int, limit: float = 15.0) -> None:
    bench_churn.wait_port(port, limit)


def rss_kb(pid: int) -> int:
    """Resident set size of a process in KiB (/proc on Linux, else ps)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


@contextlib.contextmanager
def child(mode: str, *args: str) -> Iterator[tuple[list[int], int]]:
    """One of this script's helper modes; yields the ports it prints and its pid."""
    with started([sys.executable, __file__, mode, *args], stdout=subprocess.PIPE) as process:
        assert process.stdout is not None
        yield [int(p) for p in process.stdout.readline().split()], process.pid


@contextlib.contextmanager
def proxy_process(
    workdir: Path, upstreams: list[str], extra: list[str]
) -> Iterator[tuple[int, int]]:
    """``trio-failover serve`` for ``upstreams``; yields (port, pid)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "trio_failover",
        "serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--admin-listen",
        "127.0.0.1:0",
    ]
    for spec in upstreams:
        command += ["--upstream", spec]
    log_path = workdir / f"proxy-{port}.log"
    with (
        log_path.open("wb") as log,
        started(command + extra, stdout=log, stderr=log, cwd=ROOT) as process,
    ):
        try:
            wait_port(port)
        except OSError:
            sys.exit(f"trio-failover did not start:\n{log_path.read_text()[-2000:]}")
        yield port, process.pid


def nginx_binary() -> str | None:
    candidates = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")
    return shutil.which("nginx") or next((p for p in candidates if os.access(p, os.X_OK)), None)


NGINX_CONF = """
worker_processes 1;
pid {dir}/{name}.pid;
error_log {dir}/{name}-error.log warn;
events {{ worker_connections 20000; }}
http {{
  access_log off;
  client_body_temp_path {dir}/{name}-body;
  proxy_temp_path {dir}/{name}-proxy;
  fastcgi_temp_path {dir}/{name}-fastcgi;
  uwsgi_temp_path {dir}/{name}-uwsgi;
  scgi_temp_path {dir}/{name}-scgi;
  keepalive_requests 10000000;
  {body}
}}
"""

NGINX_ORIGIN = """
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{ default_type application/json; return 200 '{answer}'; }}
  }}
"""

NGINX_PROXY = """
  upstream json {{ server 127.0.0.1:{json_port}; keepalive 32; keepalive_requests 10000000; }}
  upstream py {{ server 127.0.0.1:{py_port}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    location / {{ proxy_pass http://json; }}
    location /sse {{ proxy_pass http://py; }}
    location /slow {{ proxy_pass http://py; }}
  }}
"""


@contextlib.contextmanager
def nginx_process(binary: str, workdir: Path, name: str, body: str, port: int) -> Iterator[int]:
    conf = workdir / f"{name}.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, name=name, body=body))
    command = [
        binary,
        "-p",
        str(workdir),
        "-c",
        str(conf),
        "-e",
        str(workdir / f"{name}.err"),
        "-g",
        "daemon off;",
    ]
    with started(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:
        wait_port(port)
        yield process.pid


# -- small JSON requests ----------------------------------------------------------------


@dataclass
class LoadResult:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int = 0
    requests: int = 0


def json_request(port: int, target: bytes = b"/v1/chat/completions") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (target, port, len(JSON_REQUEST_BODY), JSON_REQUEST_BODY)
    )


def wrk_load(wrk: str, workdir: Path, port: int, clients: int, duration: float) -> LoadResult:
    script = workdir / "post.lua"
    script.write_text(
        f"wrk.method = \"POST\"\nwrk.body = '{JSON_REQUEST_BODY.decode()}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    # One wrk thread: on a small machine every other core is needed by the
    # proxy and the upstream.
    command = [
        wrk,
        "-t1",
        f"-c{clients}",
        f"-d{max(1, round(duration))}s",
        "--latency",
        "-s",
        str(script),
        f"http://127.0.0.1:{port}/v1/chat/completions",
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rps = re.search(r"Requests/sec:\s*([\d.]+)", out)
    assert rps, out
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    errors += int(non2xx.group(1)) if non2xx else 0

    def percentile(label: str) -> float:
        match = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert match, out
        return float(match.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[match.group(2)]

    count = re.search(r"(\d+) requests in", out)
    assert count, out
    return LoadResult(
        float(rps.group(1)), percentile("50"), percentile("99"), errors, int(count.group(1))
    )


class LoadClient(asyncio.Protocol):
    """One keep-alive connection sending the same request again and again."""

    def __init__(
        self, request: bytes, until: float, latencies: list[float], done: asyncio.Future[None]
    ) -> None:
        self.request, self.until, self.latencies, self.done = request, until, latencies, done
        self.buffer = bytearray()
        self.sent = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.send()

    def send(self) -> None:
        self.sent = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        match = re.search(rb"(?i)content-length:\s*(\d+)", self.buffer[:end])
        total = end + 4 + int(match.group(1)) if match else len(self.buffer)
        if len(self.buffer) < total:
            return
        now = time.perf_counter()
        self.latencies.append(now - self.sent)
        del self.buffer[:total]
        if now < self.until:
            self.send()
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def builtin_load(port: int, clients: int, duration: float) -> LoadResult:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    begin = time.perf_counter()
    request = json_request(port)
    finished = []
    for _ in range(clients):
        done: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(
            lambda d=done: LoadClient(request, begin + duration, latencies, d),  # type: ignore[misc]
            "127.0.0.1",
            port,
        )
        finished.append(done)
    await asyncio.gather(*finished)
    ordered = sorted(latencies)
    if not ordered:
        return LoadResult(0.0, float("nan"), float("nan"), 1)
    return LoadResult(
        len(ordered) / (time.perf_counter() - begin),
        percentile(ordered, 0.50) * 1000,
        percentile(ordered, 0.99) * 1000,
        requests=len(ordered),
    )


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def json_load(
    args: argparse.Namespace, workdir: Path, port: int, clients: int, pid: int | None = None
) -> tuple[LoadResult, float | None]:
    """One JSON row after a warm-up; with ``pid``, also that process's CPU µs per request."""

    def load(duration: float) -> LoadResult:
        if args.wrk:
            return wrk_load(args.wrk, workdir, port, clients, duration)
        return asyncio.run(builtin_load(port, clients, duration))

    load(1)  # warm-up: connections, pools, caches
    before = tree_cpu(pid)
    result = load(args.duration)
    after = tree_cpu(pid)
    if before is None or after is None or not result.requests:
        return result, None
    return result, (after - before) / result.requests * 1e6


def cpu_seconds(pid: int | None) -> float | None:
    """User plus system CPU time of a process so far (Linux /proc), else None."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- SSE: latency per chunk ---------------------------------------------------------------


async def sse_client(port: int, target: str, until: float, latencies: list[int]) -> None:
    import h11  # the package's own dependency

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = h11.Connection(h11.CLIENT)
    stamps = re.compile(rb"t=(\d+);")
    received = 0
    try:
        while time.perf_counter() < until:
            writer.write(
                conn.send(h11.Request(method="GET", target=target, headers=[("host", "bench")]))
                or b""
            )
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    received = time.monotonic_ns()  # before parsing: only transit counts
                    conn.receive_data(data)
                    if not data:
                        return
                elif isinstance(event, h11.Data):
                    latencies.extend(received - int(t) for t in stamps.findall(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
            conn.start_next_cycle()
    finally:
        writer.close()


async def sse_load(port: int, streams: int, duration: float, gap_ms: float) -> tuple[float, float]:
    """Per-chunk latency p50 and p99, in ms."""
    latencies: list[int] = []
    target = f"/sse?n={SSE_CHUNKS}&gap={gap_ms:g}"
    until = time.perf_counter() + duration
    await asyncio.gather(*(sse_client(port, target, until, latencies) for _ in range(streams)))
    ordered = sorted(latencies)
    return percentile(ordered, 0.5) / 1e6, percentile(ordered, 0.99) / 1e6  # type: ignore[arg-type]


# -- memory: many slow streams -------------------------------------------------------------


async def open_slow_streams(port: int, count: int) -> list[asyncio.StreamWriter]:
    """Open ``count`` streams through ``port``; each has delivered its first event."""
    writers: list[asyncio.StreamWriter] = []

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: bench\r\n\r\n")
        await reader.readuntil(b"data: hello\n\n")

    for start in range(0, count, 100):  # in batches, inside the listen backlog
        await asyncio.gather(*(one() for _ in range(min(100, count - start))))
    return writers


async def rss_with_streams(port: int, pid: int, count: int) -> int:
    writers = await asyncio.wait_for(open_slow_streams(port, count), 60)
    await asyncio.sleep(0.5)
    loaded = rss_kb(pid)
    for writer in writers:
        writer.close()
    await asyncio.sleep(0.2)
    return loaded


# -- failover precision ----------------------------------------------------------------


def timed_request(port: int) -> tuple[float, bytes]:
    """One request on a new connection; (milliseconds, answer)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        began = time.perf_counter()
        sock.sendall(json_request(port))
        data = b""
        while not data.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return (time.perf_counter() - began) * 1000, data


# -- instructions per request (callgrind) -------------------------------------------------

CALLGRIND_WARMUP = 100
CALLGRIND_REQUESTS = 500


def keepalive_requests(port: int, count: int) -> None:
    """``count`` small JSON requests, one after another, on one keep-alive connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = json_request(port)
        for _ in range(count):
            sock.sendall(request)
            read_answer(sock)


def read_answer(sock: socket.socket) -> None:
    """Read one answer with a Content-Length from ``sock``, whole."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        match = re.search(rb"(?i)content-length:\s*(\d+)", head) if sep else None
        if match and len(body) >= int(match.group(1)):
            return
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError("the connection closed mid-answer")
        data += chunk


@contextlib.contextmanager
def under_callgrind(
    command: list[str], port: int | None, workdir: Path
) -> Iterator[tuple[int, int, Callable[[], float]]]:
    """Run ``command`` under callgrind; yields (pid, port, count).

    ``port`` None: the command prints its port on its first line (the relay).
    ``count()`` zeroes the counters on its first call; each later call dumps
    them (with ``callgrind_control``) and returns the instructions since.
    """
    out = workdir / "callgrind"
    out.mkdir(exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    valgrind = [
        "valgrind",
        "--tool=callgrind",
        "--trace-children=yes",  # serve execs a fresh image of itself
        f"--callgrind-out-file={out}/cg.%p",
    ]
    log = (workdir / "callgrind.log").open("wb")
    stdout = subprocess.PIPE if port is None else log
    with log, started(valgrind + command, stdout=stdout, stderr=log, cwd=ROOT) as process:
        if port is None:
            assert process.stdout is not None
            port = int(process.stdout.readline().split()[0])
        wait_port(port, limit=120)  # Python under valgrind starts slowly
        zeroed = False

        def count() -> float:
            nonlocal zeroed
            control = ["callgrind_control", "--dump" if zeroed else "--zero", str(process.pid)]
            subprocess.run(control, check=True, capture_output=True)
            if not zeroed:
                zeroed = True
                return 0.0
            return callgrind_total(out, process.pid)

        yield process.pid, port, count


def callgrind_total(out: Path, pid: int) -> float:
    """The instruction total of ``pid``'s last callgrind dump in ``out``."""
    dumps = sorted(out.glob(f"cg.{pid}.*"), key=lambda path: path.stat().st_mtime)
    if not dumps:
        raise OSError("callgrind wrote no dump")
    text = dumps[-1].read_text(errors="replace")
    total = re.search(r"(?m)^(?:summary|totals):\s*(\d+)", text)
    if total is None:
        raise OSError(f"no total in {dumps[-1]}")
    return int(total.group(1))


def instructions_per_request(command: list[str], port: int | None, workdir: Path) -> float:
    """Instructions ``command`` spends per small JSON request, after a warm-up."""
    with under_callgrind(command, port, workdir) as (_pid, port, count):
        keepalive_requests(port, CALLGRIND_WARMUP)
        count()
        keepalive_requests(port, CALLGRIND_REQUESTS)
        return count() / CALLGRIND_REQUESTS


CALLGRIND_STREAMS = 5
CALLGRIND_STREAM_SECONDS = 4.0


def instructions_per_chunk(
    command: Callable[[int], list[str]], port: int | None, workdir: Path
) -> tuple[float, int]:
    """Instructions ``command(upstream_port)`` spends per relayed chunk, and the chunks.

    Few and slow streams, because under callgrind the relay runs some 50
    times slower, and a backlog would merge chunks into fewer, larger reads.
    """
    with (
        child_stream_upstream() as (upstream_port, _),
        under_callgrind(command(upstream_port), port, workdir) as (_, port, count),
        started(
            bench_stream.command("clients", str(port), str(CALLGRIND_STREAMS)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        ) as clients,
    ):
        assert clients.stdin is not None
        assert clients.stdout is not None
        clients.stdout.readline()  # "open N"
        time.sleep(2)  # warm-up
        count()
        clients.stdin.write(b"go\n")
        clients.stdin.flush()
        time.sleep(CALLGRIND_STREAM_SECONDS)
        total = count()
        clients.stdin.write(b"stop\n")
        clients.stdin.flush()
        chunks = int(clients.stdout.readline().split()[0])
    return total / max(chunks, 1), chunks


def run_instructions(s: Setup) -> None:
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        s.report.out("Instructions per request: valgrind is not installed, no count")
        s.report.out()
        return
    port = free_port()
    proxy = [sys.executable, "-m", "trio_failover", "serve", "--listen", f"127.0.0.1:{port}"]
    proxy += ["--admin-listen", "off", "--upstream", f"http://127.0.0.1:{s.json_port}"]
    ours = instructions_per_request(proxy + s.args.proxy_arg, port, s.workdir)
    relay = [sys.executable, __file__, "relay", str(s.json_port)]
    bare = instructions_per_request(relay, None, s.workdir)
    relay_io = [sys.executable, __file__, "relay-io", str(s.json_port)]
    bare_io = instructions_per_request(relay_io, None, s.workdir)
    pump = [sys.executable, __file__, "pump", str(s.json_port)]
    floor = instructions_per_request(pump, None, s.workdir)
    httptools = ""
    if has_httptools():
        command = [sys.executable, __file__, "httptools", str(s.json_port)]
        httptools = (
            f"; httptools relay {instructions_per_request(command, None, s.workdir) / 1e6:.2f} M"
        )
    s.report.out(
        f"Instructions per small JSON request (callgrind, user space; one keep-alive client, "
        f"{CALLGRIND_REQUESTS} requests after {CALLGRIND_WARMUP})"
    )
    s.report.out(
        f"  trio-failover {ours / 1e6:.2f} M; bare relay {bare / 1e6:.2f} M: {ours / bare:.2f} x; "
        f"trio pump (no HTTP) {floor / 1e6:.2f} M{httptools}"
    )
    s.report.out(
        f"  bare relay on the proxy's socket I/O (wire/http1) {bare_io / 1e6:.2f} M: "
        f"trio-failover {ours / bare_io:.2f} x of it"
    )
    s.report.target(
        f"instructions per request <= {TARGET_REQUEST_CPU_RATIO} x bare relay",
        f"{ours / bare:.2f} x",
        ours / bare <= TARGET_REQUEST_CPU_RATIO,
    )

    def proxy_for(upstream_port: int) -> list[str]:
        return [*proxy[:-1], f"http://127.0.0.1:{upstream_port}", *s.args.proxy_arg]

    def relay_for(upstream_port: int, mode: str = "relay") -> list[str]:
        return [sys.executable, __file__, mode, str(upstream_port)]

    (ours, our_chunks) = instructions_per_chunk(proxy_for, port, s.workdir)
    (bare, bare_chunks) = instructions_per_chunk(relay_for, None, s.workdir)
    (bare_io, _) = instructions_per_chunk(
        lambda upstream_port: relay_for(upstream_port, "relay-io"), None, s.workdir
    )
    s.report.out(
        f"Instructions per relayed SSE chunk ({CALLGRIND_STREAMS} streams, a chunk every "
        f"{1000 // TOKENS_PER_SECOND} ms each, {CALLGRIND_STREAM_SECONDS:g} s: "
        f"{our_chunks} and {bare_chunks} chunks)"
    )
    if min(our_chunks, bare_chunks) < CALLGRIND_STREAMS * CALLGRIND_STREAM_SECONDS:
        s.report.out("  too few chunks arrived to count instructions per chunk")
    else:
        s.report.out(
            f"  trio-failover {ours / 1e3:.0f} k; bare relay {bare / 1e3:.0f} k: "
            f"{ours / bare:.2f} x; bare relay on the proxy's socket I/O {bare_io / 1e3:.0f} k: "
            f"trio-failover {ours / bare_io:.2f} x of it"
        )
    s.report.out()


# -- streaming: how many streams one process relays ----------------------------------

STREAM_LADDER = (100, 250, 500, 1000, 2000, 4000)
TOKENS_PER_SECOND = 10  # per stream: bench_stream.PERIOD_NS
TARGET_STREAM_P99_MS = 25.0
TARGET_STREAMS = 1000
TARGET_CHUNK_CPU_RATIO = 1.15


def process_tree(pid: int) -> list[int]:
    """``pid`` and its direct children (nginx's master and its worker)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return [pid, *children]


def tree_cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    seconds = [cpu_seconds(p) for p in process_tree(pid)]
    return sum(s for s in seconds if s is not None) if seconds[0] is not None else None


def tree_rss(pid: int | None) -> int | None:
    return None if pid is None else sum(rss_kb(p) for p in process_tree(pid))


@dataclass
class StreamStep:
    """What N concurrent streams through one system did in one window."""

    streams: int
    opened: int
    chunks: int = 0
    seconds: float = 0.0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    max_ms: float = float("nan")
    broken: int = 0
    cpu_us: float | None = None  # the system's CPU per relayed chunk
    rss_kb: float | None = None  # the system's RSS per open stream, over its idle RSS
    upstream_cpu: float = 0.0  # share of one core, in the window
    clients_cpu: float = 0.0

    @property
    def rate_ok(self) -> bool:
        expected = self.streams * TOKENS_PER_SECOND * self.seconds
        return self.chunks >= 0.95 * expected

    @property
    def ok(self) -> bool:
        return (
            self.opened == self.streams
            and not self.broken
            and self.rate_ok
            and self.p99_ms <= TARGET_STREAM_P99_MS
        )


def stream_step(
    port: int,
    pid: int | None,
    upstream_pid: int,
    streams: int,
    idle_rss: int | None,
    warmup: float,
    duration: float,
) -> StreamStep:
    """Open ``streams`` streams through ``port``, let them settle, measure a window."""
    command = bench_stream.command("clients", str(port), str(streams))
    with started(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as clients:
        assert clients.stdin is not None
        assert clients.stdout is not None
        opened = int(clients.stdout.readline().split()[1])
        step = StreamStep(streams, opened)
        if opened < streams:
            return step
        time.sleep(warmup)
        rss = tree_rss(pid)
        cpu, upstream_cpu = tree_cpu(pid), cpu_seconds(upstream_pid) or 0.0
        clients.stdin.write(b"go\n")
        clients.stdin.flush()
        time.sleep(duration)
        clients.stdin.write(b"stop\n")
        clients.stdin.flush()
        cpu_after, upstream_after = tree_cpu(pid), cpu_seconds(upstream_pid) or 0.0
        fields = clients.stdout.readline().split()
    chunks, seconds = int(fields[0]), float(fields[5])
    step.chunks, step.seconds, step.broken = chunks, seconds, int(fields[6])
    step.p50_ms, step.p99_ms, step.max_ms = (float(f) for f in fields[1:4])
    step.clients_cpu = float(fields[4]) / seconds
    step.upstream_cpu = (upstream_after - upstream_cpu) / seconds
    if cpu is not None and cpu_after is not None and chunks:
        step.cpu_us = (cpu_after - cpu) / chunks * 1e6
    if rss is not None and idle_rss is not None:
        step.rss_kb = (rss - idle_rss) / opened
    time.sleep(0.5)  # the streams close before the next step
    return step


def stream_row(name: str, step: StreamStep, relay_cpu: float | None) -> str:
    cpu = f"{step.cpu_us:7.0f}" if step.cpu_us is not None else " " * 7
    ratio = f"{step.cpu_us / relay_cpu:6.2f}" if step.cpu_us and relay_cpu else " " * 6
    rss = f"{step.rss_kb:7.1f}" if step.rss_kb is not None else " " * 7
    rate = step.chunks / step.seconds if step.seconds else 0.0
    notes = []
    if step.opened < step.streams:
        notes.append(f"only {step.opened} opened")
    if step.broken:
        notes.append(f"{step.broken} broke")
    if step.seconds and not step.rate_ok:
        notes.append("chunks late")
    return (
        f"{name:13s} {step.streams:6d} {rate:8.0f}  {ms(step.p50_ms)}  {ms(step.p99_ms)}  "
        f"{ms(step.max_ms)}  {cpu}  {ratio}  {rss}  {step.upstream_cpu * 100:4.0f}% "
        f"{step.clients_cpu * 100:4.0f}%  {'ok' if step.ok else 'over'}"
        + (f" ({', '.join(notes)})" if notes else "")
    )


@contextlib.contextmanager
def stream_systems(s: Setup, upstream_port: int, name: str) -> Iterator[tuple[int, int | None]]:
    """Start one system in front of the streaming upstream; yields (port, pid)."""
    top = max(s.args.stream_ladder) + 100
    if name == "direct":
        yield upstream_port, None
    elif name == "trio-failover":
        extra = ["--max-connections", str(top), *s.args.proxy_arg]
        with proxy_process(s.workdir, [f"stream=http://127.0.0.1:{upstream_port}"], extra) as (
            port,
            pid,
        ):
            yield port, pid
    elif name == "bare relay":
        with child("relay", str(upstream_port)) as ((port,), pid):
            yield port, pid
    elif name == "nginx":
        assert s.nginx is not None
        port = free_port()
        body = NGINX_STREAM.format(port=port, upstream_port=upstream_port)
        with nginx_process(s.nginx, s.workdir, "stream", body, port) as pid:
            yield port, pid
    else:
        with litellm_process(s, upstream_port) as (port, pid):
            yield port, pid


def stream_ladder(
    s: Setup, upstream_port: int, upstream_pid: int, name: str, top: int
) -> list[StreamStep]:
    """Steps up the ladder (to ``top``) until the p99 delay passes the target."""
    steps: list[StreamStep] = []
    with stream_systems(s, upstream_port, name) as (port, pid):
        stream_step(port, pid, upstream_pid, 10, None, 0.3, 0.5)  # warm-up
        time.sleep(0.5)
        idle = tree_rss(pid)
        for streams in (n for n in s.args.stream_ladder if n <= top):
            step = stream_step(
                port,
                pid,
                upstream_pid,
                streams,
                idle,
                s.args.stream_warmup,
                s.args.stream_duration,
            )
            steps.append(step)
            s.report.out(stream_row(name, step, s.stream_relay_cpu.get(streams)))
            if name == "bare relay" and step.cpu_us is not None:
                s.stream_relay_cpu[streams] = step.cpu_us
            if not step.ok:
                break
    return steps


def largest_ok(steps: list[StreamStep]) -> int:
    return max((step.streams for step in steps if step.ok), default=0)


def run_stream(s: Setup) -> None:
    ladder = s.args.stream_ladder
    top = min(max(ladder), (resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 200) // 2)
    s.report.out(
        f"Streaming: N concurrent SSE streams, a ~100 B event every "
        f"{1000 // TOKENS_PER_SECOND} ms each; delay from the upstream's write to the "
        f"client's read; {s.args.stream_warmup:g} s settling, then {s.args.stream_duration:g} s "
        f"measured per row; N up {','.join(str(n) for n in ladder if n <= top)} "
        f"until p99 > {TARGET_STREAM_P99_MS:g} ms"
    )
    s.report.out(
        "path          streams chunks/s   p50 ms   p99 ms   max ms  CPU us/chunk x relay"
        "  KiB/stream  upstream clients"
    )
    names = ["direct", "bare relay", "trio-failover"]
    if s.nginx:
        names.append("nginx")
    if s.args.litellm:
        names.append("litellm")
    results: dict[str, list[StreamStep]] = {}
    generators_limit = False
    with child_stream_upstream() as (upstream_port, upstream_pid):
        for name in names:
            results[name] = stream_ladder(s, upstream_port, upstream_pid, name, top)
            if name == "direct" and 0 < largest_ok(results["direct"]) < top:
                # Past this the load generators, not the systems, are measured.
                top, generators_limit = largest_ok(results["direct"]), True
    s.report.out()
    stream_summary(s, results, top, generators_limit)


def stream_summary(
    s: Setup, results: dict[str, list[StreamStep]], top: int, generators_limit: bool
) -> None:
    why = "the load generators' limit" if generators_limit else "the ladder's top"
    s.report.out(
        f"Largest N with p99 <= {TARGET_STREAM_P99_MS:g} ms, and what one core would relay at "
        f"the CPU per chunk measured there ({TOKENS_PER_SECOND} chunks/s per stream):"
    )
    for name, steps in results.items():
        n = largest_ok(steps)
        capped = bool(steps) and steps[-1].ok and steps[-1].streams >= top
        passed = [step for step in steps if step.ok and step.cpu_us]
        core = (
            f"; one core: ~{1e6 / passed[-1].cpu_us / TOKENS_PER_SECOND:,.0f} streams"
            if passed and passed[-1].cpu_us
            else ""
        )
        s.report.out(
            f"  {name:13s} {'>= ' if capped else ''}{n or f'< {min(s.args.stream_ladder)}'}"
            + (f" ({why})" if capped else "")
            + core
        )
    s.report.out()
    ours = {step.streams: step for step in results["trio-failover"] if step.ok}
    bare = {step.streams: step for step in results["bare relay"] if step.ok}
    ratios = {
        n: ours[n].cpu_us / bare[n].cpu_us  # type: ignore[operator]
        for n in sorted(ours.keys() & bare.keys())
        if ours[n].cpu_us and bare[n].cpu_us
    }
    if ratios:
        s.report.target(
            f"stream CPU per chunk <= {TARGET_CHUNK_CPU_RATIO} x bare relay",
            ", ".join(f"{r:.2f} x at {n}" for n, r in ratios.items()),
            max(ratios.values()) <= TARGET_CHUNK_CPU_RATIO,
        )
    n = largest_ok(results["trio-failover"])
    s.report.target(
        f">= {TARGET_STREAMS} streams within p99 {TARGET_STREAM_P99_MS:g} ms",
        f"{n} streams" + (f" ({why})" if n >= top else ""),
        n >= TARGET_STREAMS,
    )
    rss = [step.rss_kb for step in ours.values() if step.rss_kb is not None and step.streams >= 250]
    if rss:
        s.report.target(
            f"stream RSS per open stream <= {TARGET_RSS_PER_STREAM_KB} KB",
            f"{max(rss):.1f} KiB",
            max(rss) <= TARGET_RSS_PER_STREAM_KB,
        )


@contextlib.contextmanager
def litellm_process(s: Setup, upstream_port: int) -> Iterator[tuple[int, int]]:
    """The LiteLLM proxy (one worker), ``upstream_port`` its OpenAI-compatible model ``bench``."""
    port = free_port()
    command = [
        s.args.litellm,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
        "--model",
        "openai/bench",
        "--api_base",
        f"http://127.0.0.1:{upstream_port}/v1",
    ]
    env = {
        **os.environ,
        "OPENAI_API_KEY": "bench",
        # Without a master key it refuses to start unless told that this
        # is local use; so the clients need no Authorization header.
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else it fetches a price list at start
    }
    log_path = s.workdir / "litellm.log"
    with log_path.open("wb") as log, started(command, stdout=log, stderr=log, env=env) as process:
        try:
            wait_port(port, limit=120)
        except OSError:
            sys.exit(f"litellm did not start:\n{log_path.read_text()[-2000:]}")
        yield port, process.pid


@contextlib.contextmanager
def child_stream_upstream() -> Iterator[tuple[int, int]]:
    """The streaming upstream of bench_stream.choose's generators; yields (port, pid)."""
    command = bench_stream.command("upstream")
    with started(command, stdout=subprocess.PIPE) as process:
        assert process.stdout is not None
        yield int(process.stdout.readline()), process.pid


NGINX_STREAM = """
  upstream stream {{ server 127.0.0.1:{upstream_port}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    location / {{ proxy_pass http://stream; }}
  }}
"""


# -- the report --------------------------------------------------------------------------


@dataclass
class Report:
    targets: list[tuple[str, str, bool]] = field(default_factory=list)

    def out(self, line: str = "") -> None:
        print(line, flush=True)

    def target(self, name: str, measured: str, met: bool) -> None:
        self.targets.append((name, measured, met))


def ms(value: float) -> str:
    return f"{value:7.3f}"


@dataclass
class Setup:
    args: argparse.Namespace
    report: Report
    workdir: Path
    py_port: int
    frozen_port: int
    json_port: int
    origin: str
    nginx_port: int | None
    nginx: str | None = None
    stream_relay_cpu: dict[int, float] = field(default_factory=dict)  # N -> bare relay us/chunk


def run_json(s: Setup) -> None:
    s.report.out(
        f"Small JSON requests: POST {len(JSON_REQUEST_BODY)} B, answer "
        f"{len(JSON_ANSWER)} B from {s.origin}; {s.args.duration:g} s per row"
    )
    s.report.out(
        "clients  path            req/s  x direct   p50 ms   p99 ms  +p50 ms  +p99 ms  CPU us/req"
    )
    results: dict[tuple[str, int], LoadResult] = {}
    cpus: dict[tuple[str, int], float | None] = {}
    with (
        proxy_process(s.workdir, [f"fast=http://127.0.0.1:{s.json_port}"], s.args.proxy_arg) as (
            port,
            pid,
        ),
        child("relay", str(s.json_port)) as ((relay_port,), relay_pid),
        child("pump", str(s.json_port)) as ((pump_port,), pump_pid),
        contextlib.ExitStack() as optional,
    ):
        paths: list[tuple[str, int, int | None]] = [
            ("direct", s.json_port, None),
            ("trio-failover", port, pid),
            ("bare relay", relay_port, relay_pid),
            ("trio pump", pump_port, pump_pid),
        ]
        if has_httptools():
            (httptools_port,), httptools_pid = optional.enter_context(
                child("httptools", str(s.json_port))
            )
            paths.append(("httptools", httptools_port, httptools_pid))
        if s.nginx_port:
            paths.append(("nginx", s.nginx_port, None))
        if s.args.litellm:
            litellm_port, litellm_pid = optional.enter_context(litellm_process(s, s.json_port))
            paths.append(("litellm", litellm_port, litellm_pid))
        for clients in CONCURRENCY:
            for name, target, target_pid in paths:
                result, cpu = json_load(s.args, s.workdir, target, clients, target_pid)
                results[name, clients] = result
                cpus[name, clients] = cpu
                direct = results["direct", clients]
                added = (
                    " " * 16
                    if name == "direct"
                    else (
                        f"{ms(result.p50_ms - direct.p50_ms)}  {ms(result.p99_ms - direct.p99_ms)}"
                    )
                )
                cpu_text = f"  {cpu:6.0f}" if cpu is not None else ""
                errors = f"  ({result.errors} errors)" if result.errors else ""
                s.report.out(
                    f"{clients:7d}  {name:13s} {result.rps:7.0f}  "
                    f"{result.rps / direct.rps:7.3f}  {ms(result.p50_ms)}  "
                    f"{ms(result.p99_ms)}  {added}{cpu_text}{errors}"
                )
        after_load = rss_kb(pid)
    s.report.out(f"(trio-failover RSS after this load: {after_load / 1024:.1f} MiB)")
    s.report.out()
    ratios = {
        clients: ours / bare
        for clients in CONCURRENCY
        if (ours := cpus.get(("trio-failover", clients)))
        and (bare := cpus.get(("bare relay", clients)))
    }
    if ratios:
        s.report.target(
            f"CPU time per request <= {TARGET_REQUEST_CPU_RATIO} x bare relay",
            ", ".join(f"{ratio:.2f} x at {clients}" for clients, ratio in ratios.items()),
            max(ratios.values()) <= TARGET_REQUEST_CPU_RATIO,
        )


def run_sse(s: Setup) -> None:
    s.report.out(
        f"SSE: {SSE_CHUNKS} chunks per stream; latency per chunk from the upstream's "
        f"write to the client's read; {s.args.sse_duration:g} s per row"
    )
    s.report.out("streams  gap    path           p50 ms   p99 ms  +p50 ms  +p99 ms")
    results: dict[tuple[str, int, float], tuple[float, float]] = {}
    with (
        proxy_process(s.workdir, [f"py=http://127.0.0.1:{s.py_port}"], s.args.proxy_arg) as (
            port,
            _pid,
        ),
        child("relay", str(s.py_port)) as ((relay_port,), _relay_pid),
    ):
        paths = [("direct", s.py_port), ("trio-failover", port), ("bare relay", relay_port)]
        if s.nginx_port:
            paths.append(("nginx", s.nginx_port))
        for streams, gap in [(n, 0.0) for n in SSE_CONCURRENCY] + [(1, SSE_GAP_MS)]:
            for name, target in paths:
                asyncio.run(sse_load(target, streams, 0.3, gap))  # warm-up
                p50, p99 = asyncio.run(sse_load(target, streams, s.args.sse_duration, gap))
                results[name, streams, gap] = (p50, p99)
                d50, d99 = results["direct", streams, gap]
                added = "" if name == "direct" else f"{ms(p50 - d50)}  {ms(p99 - d99)}"
                s.report.out(f"{streams:7d}  {gap:g} ms  {name:13s} {ms(p50)}  {ms(p99)}  {added}")
    s.report.out()
    added_p50 = results["trio-failover", 1, 0.0][0] - results["direct", 1, 0.0][0]
    s.report.target(
        f"added per-chunk p50, 1 stream, no gap <= {TARGET_CHUNK_P50_MS} ms",
        f"{added_p50:.3f} ms",
        added_p50 <= TARGET_CHUNK_P50_MS,
    )


def run_memory(s: Setup) -> None:
    s.report.out(
        f"Memory: RSS of a fresh trio-failover process, idle (after 10 requests) and "
        f"with {SLOW_STREAMS} open slow streams"
    )
    with proxy_process(s.workdir, [f"py=http://127.0.0.1:{s.py_port}"], s.args.proxy_arg) as (
        port,
        pid,
    ):
        for _ in range(10):
            timed_request(port)
        time.sleep(0.3)
        idle = rss_kb(pid)
        loaded = asyncio.run(rss_with_streams(port, pid, SLOW_STREAMS))
    per_stream = (loaded - idle) / SLOW_STREAMS
    s.report.out(
        f"  idle {idle / 1024:.1f} MiB; with {SLOW_STREAMS} streams "
        f"{loaded / 1024:.1f} MiB: {per_stream:.1f} KiB per stream"
    )
    s.report.out()
    s.report.target(
        f"RSS idle <= {TARGET_RSS_IDLE_MB} MB",
        f"{idle / 1024:.1f} MiB",
        idle / 1024 <= TARGET_RSS_IDLE_MB,
    )
    s.report.target(
        f"RSS per open stream <= {TARGET_RSS_PER_STREAM_KB} KB",
        f"{per_stream:.1f} KiB",
        per_stream <= TARGET_RSS_PER_STREAM_KB,
    )


def run_failover(s: Setup) -> None:
    # Like is compared with like. Every measured request comes 250 ms after
    # the last one (time for the cooldown to run out), and a machine that
    # sat idle that long answers its first request slower (caches gone cold,
    # CPUs asleep), stall or no stall. So the baseline is taken the same way,
    # from a proxy with only the fast node: a first request after 250 ms idle
    # (compared with the stall) and the request right after it (compared with
    # the request after the stall). Each proxy first runs one unmeasured round.
    idle = STALL_DEADLINE_MS / 1000 + 0.05
    fast = f"fast=http://127.0.0.1:{s.py_port}"
    firsts, seconds = [], []
    with proxy_process(s.workdir, [fast], s.args.proxy_arg) as (port, _pid):
        for _ in range(20):
            timed_request(port)
        for round_number in range(s.args.stalls + 1):
            time.sleep(idle)
            first, second = timed_request(port)[0], timed_request(port)[0]
            if round_number:
                firsts.append(first)
                seconds.append(second)
    normal_first, normal_second = statistics.median(firsts), statistics.median(seconds)
    stalls, afters = [], []
    nodes = [f"frozen=http://127.0.0.1:{s.frozen_port}", fast]
    # The JSON request says "stream": false, whose head deadline is
    # --unstreamed-timeout, not --response-header-timeout.
    deadline = f"{STALL_DEADLINE_MS}ms"
    extra = [
        "--response-header-timeout",
        deadline,
        "--unstreamed-timeout",
        deadline,
        *s.args.proxy_arg,
    ]
    with proxy_process(s.workdir, nodes, extra) as (port, _pid):
        for round_number in range(s.args.stalls + 1):
            time.sleep(idle)  # the cooldown of the last round runs out
            elapsed, answer = timed_request(port)
            assert b"x-failover-node: fast" in answer.lower(), answer[:300]
            after = timed_request(port)[0]
            if round_number:
                stalls.append(elapsed - STALL_DEADLINE_MS - normal_first)
                afters.append(after - normal_second)
    s.report.out(
        f"Failover: the first node accepts and never answers; "
        f"--response-header-timeout and --unstreamed-timeout {STALL_DEADLINE_MS}ms; "
        f"{s.args.stalls} stalls. Without "
        f"a stall, a request on a new connection takes {normal_first:.3f} ms after "
        f"{idle * 1000:.0f} ms idle, and the one right after it {normal_second:.3f} ms"
    )
    s.report.out(
        f"  a stall costs its deadline + {statistics.median(stalls):.2f} ms "
        f"(median; max {max(stalls):.2f} ms)"
    )
    s.report.out(
        f"  the next request, the node cooling, pays {statistics.median(afters):+.3f} ms "
        f"(median; max {max(afters):+.3f} ms)"
    )
    s.report.out()
    s.report.target(
        f"a stall costs its deadline + <= {TARGET_STALL_EXTRA_MS} ms",
        f"+{statistics.median(stalls):.2f} ms (median), +{max(stalls):.2f} (max)",
        max(stalls) <= TARGET_STALL_EXTRA_MS,
    )
    after = statistics.median(afters)
    s.report.target(
        f"the request after a stall pays <= {TARGET_AFTER_STALL_MS} ms",
        f"{after:+.3f} ms (median)",
        after <= TARGET_AFTER_STALL_MS,
    )


AFFINITY_PROMPTS = ((2_000, 400), (100_000, 150))  # (prompt bytes, requests per run)
AFFINITY_CONVERSATIONS = 20
AFFINITY_RUNS = 3


def affinity_bodies(size: int) -> list[bytes]:
    """``AFFINITY_CONVERSATIONS`` chat requests of about ``size`` bytes of prompt each.

    A system prompt they share, then messages of their own of about 2.5 KB
    (a 2 KB prompt: four of about 400 B), as an agent's context grows.
    """
    part = 400 if size < 10_000 else 2_500
    bodies = []
    for number in range(AFFINITY_CONVERSATIONS):
        messages = [{"role": "system", "content": "You are a coding agent. " * (part // 24)}]
        while sum(len(m["content"]) for m in messages) < size:
            role = "user" if len(messages) % 2 else "assistant"
            text = f"conversation {number} message {len(messages)}: "
            messages.append({"role": role, "content": text + "x" * (part - len(text))})
        document = {"model": "bench", "messages": messages, "max_tokens": 4, "stream": False}
        bodies.append(json.dumps(document).encode())
    return bodies


def keepalive_posts(port: int, bodies: list[bytes], count: int) -> None:
    """``count`` POSTs of ``bodies`` in turn, one after another, on one keep-alive connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index in range(count):
            body = bodies[index % len(bodies)]
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (port, len(body), body)
            )
            read_answer(sock)


AFFINITY_CALLGRIND = ((2_000, 100), (100_000, 30))  # (prompt bytes, requests counted)


def run_affinity(s: Setup) -> None:
    s.report.out(
        f"Cache affinity: the proxy's cost per request, {AFFINITY_CONVERSATIONS} conversations "
        f"in turn, one keep-alive client"
    )
    counted = shutil.which("valgrind") and shutil.which("callgrind_control")
    s.report.out(
        "prompt   affinity   CPU us/req (median of "
        f"{AFFINITY_RUNS} alternated runs)" + ("   instructions/req (callgrind)" if counted else "")
    )
    ratios: dict[int, tuple[float, float | None]] = {}
    for (size, count), (_, calls) in zip(AFFINITY_PROMPTS, AFFINITY_CALLGRIND, strict=True):
        bodies = affinity_bodies(size)
        figures: dict[str, list[float]] = {"off": [], "prefix": []}
        for _ in range(AFFINITY_RUNS):
            for mode in figures:
                extra = [*s.args.proxy_arg, f"--affinity={mode}"]
                with proxy_process(s.workdir, [f"fast=http://127.0.0.1:{s.json_port}"], extra) as (
                    port,
                    pid,
                ):
                    keepalive_posts(port, bodies, count // 5)  # warm-up
                    before = cpu_seconds(pid)
                    keepalive_posts(port, bodies, count)
                    after = cpu_seconds(pid)
                if before is not None and after is not None:
                    figures[mode].append((after - before) / count * 1e6)
        instructions: dict[str, float] = {}
        if counted:
            for mode in figures:
                port = free_port()
                proxy = [sys.executable, "-m", "trio_failover", "serve"]
                proxy += ["--listen", f"127.0.0.1:{port}", "--admin-listen", "off"]
                proxy += ["--upstream", f"http://127.0.0.1:{s.json_port}", f"--affinity={mode}"]
                with under_callgrind(proxy + s.args.proxy_arg, port, s.workdir) as (_, _, total):
                    keepalive_posts(port, bodies, AFFINITY_CONVERSATIONS)  # warm-up
                    total()
                    keepalive_posts(port, bodies, calls)
                    instructions[mode] = total() / calls
        cpu = {mode: statistics.median(values) for mode, values in figures.items() if values}
        for mode in figures:
            cpu_text = f"{cpu[mode]:9.0f}" if mode in cpu else "        -"
            counted_text = f"   {instructions[mode] / 1e6:9.2f} M" if mode in instructions else ""
            s.report.out(f"{size / 1000:4.0f} KB   {mode:8s}  {cpu_text}{counted_text}")
        cpu_ratio = cpu["prefix"] / cpu["off"] if len(cpu) == 2 else float("nan")
        count_ratio = instructions["prefix"] / instructions["off"] if instructions else None
        ratios[size] = (cpu_ratio, count_ratio)
        counted_ratio = f"   {count_ratio:9.3f} x" if count_ratio is not None else ""
        s.report.out(f"{size / 1000:4.0f} KB   on / off  {cpu_ratio:9.3f} x{counted_ratio}")
    s.report.out()
    cpu_ratio, count_ratio = ratios[AFFINITY_PROMPTS[-1][0]]
    ratio = count_ratio if count_ratio is not None else cpu_ratio
    s.report.target(
        "cache affinity, 100 KB prompt: cost per request at most +20 % over off "
        + ("(instructions)" if count_ratio is not None else "(CPU time)"),
        f"{ratio:.3f} x",
        ratio <= TARGET_AFFINITY_CPU_RATIO,
    )


def run_churn(s: Setup) -> None:
    for name, measured, met in bench_churn.run_churn(s.args, s.report.out, s.args.proxy_arg):
        s.report.target(name, measured, met)
    s.report.out()


def run_scheduler(s: Setup) -> None:
    for line in bench_scheduler.lines():
        s.report.out(line)
    s.report.out()


def run(args: argparse.Namespace) -> int:
    import h11
    import trio

    import trio_failover

    raise_fd_limit()
    report = Report()
    nginx = None if args.no_nginx else nginx_binary()
    if args.wrk:
        version = subprocess.run([args.wrk, "-v"], capture_output=True, text=True).stdout
        loadgen = f"wrk {version.split()[1] if version.split() else ''} (one thread)"
    else:
        loadgen = "built-in asyncio client (wrk not found; it shares the CPUs with the proxy)"
    if nginx:
        out = subprocess.run([nginx, "-v"], capture_output=True, text=True)
        nginx_text = (out.stderr or out.stdout).strip().rpartition("/")[2] + " (one worker)"
    else:
        nginx_text = "not installed: no nginx row"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    report.out(
        f"trio-failover {trio_failover.__version__} benchmark, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; command: {' '.join(sys.argv)}"
    )
    report.out(
        f"machine: {os.cpu_count()} CPUs, {platform.machine()}, {platform.system()} "
        f"{platform.release()}; load average {load:.2f} at start"
    )
    report.out(
        f"python {platform.python_version()}, trio {trio.__version__}, "
        f"h11 {getattr(h11, '__version__', '?')}; load: {loadgen}; nginx: {nginx_text}"
    )
    report.out(f"trio-failover flags: {' '.join(args.proxy_arg) or '(defaults)'}")
    report.out(bench_stream.choose(args.generators))
    if os.cpu_count() and load > 0.5 * os.cpu_count():  # type: ignore[operator]
        report.out("WARNING: the machine is busy; figures will be low and noisy")
    report.out()

    with (
        tempfile.TemporaryDirectory(prefix="trio-failover-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        workdir = Path(tmp)
        (py_port, frozen_port), _ = stack.enter_context(child("upstream"))
        wait_port(py_port)
        json_port, origin, nginx_port = py_port, "the built-in asyncio upstream", None
        if nginx:
            json_port, nginx_port = free_port(), free_port()
            answer = JSON_ANSWER.decode()
            stack.enter_context(
                nginx_process(
                    nginx,
                    workdir,
                    "origin",
                    NGINX_ORIGIN.format(port=json_port, answer=answer),
                    json_port,
                )
            )
            stack.enter_context(
                nginx_process(
                    nginx,
                    workdir,
                    "proxy",
                    NGINX_PROXY.format(port=nginx_port, json_port=json_port, py_port=py_port),
                    nginx_port,
                )
            )
            origin = "nginx (return 200)"
        setup = Setup(
            args, report, workdir, py_port, frozen_port, json_port, origin, nginx_port, nginx
        )
        parts = args.only.split(",")
        for name, part in (
            ("json", run_json),
            ("sse", run_sse),
            ("memory", run_memory),
            ("failover", run_failover),
            ("stream", run_stream),
            ("churn", run_churn),
            ("scheduler", run_scheduler),
            ("affinity", run_affinity),
            ("instructions", run_instructions),
        ):
            if name in parts:
                part(setup)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    report.out(f"Targets (load average {load:.2f} at the end)")
    for name, measured, met in report.targets:
        report.out(f"  {'met' if met else 'NOT met':8s} {name}: {measured}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "mode",
        nargs="?",
        default="bench",
        choices=["bench", "upstream", "relay", "relay-io", "pump", "httptools"],
    )
    parser.add_argument("port", nargs="?", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--duration",
        type=float,
        default=4.0,
        help="seconds per JSON row (default 4; wrk rounds to whole seconds)",
    )
    parser.add_argument(
        "--sse-duration", type=float, default=2.0, help="seconds per SSE row (default 2)"
    )
    parser.add_argument(
        "--stream-duration",
        type=float,
        default=2.0,
        help="seconds measured per streaming row (default 2)",
    )
    parser.add_argument(
        "--stream-warmup",
        type=float,
        default=1.0,
        help="seconds the streams run before each streaming row is measured (default 1)",
    )
    parser.add_argument(
        "--stream-ladder",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=STREAM_LADDER,
        metavar="N,N,...",
        help=f"stream counts to climb (default: {','.join(map(str, STREAM_LADDER))})",
    )
    parser.add_argument(
        "--litellm",
        metavar="PATH",
        default=shutil.which("litellm"),
        help="the litellm proxy command, for a LiteLLM row (default: litellm on PATH, if any)",
    )
    parser.add_argument("--stalls", type=int, default=10, help="stalls to time (default 10)")
    parser.add_argument(
        "--only",
        default="json,sse,memory,failover,stream,churn,scheduler,affinity,instructions",
        help="comma-separated parts to run (default: all eight; instructions needs valgrind)",
    )
    bench_churn.add_arguments(parser)
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx out even if installed")
    parser.add_argument(
        "--no-wrk",
        action="store_true",
        help="use the built-in load generator even if wrk is installed",
    )
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for trio-failover serve, e.g. --proxy-arg=--log-level=warning (repeat)",
    )
    args = parser.parse_args()
    if args.mode == "upstream":
        asyncio.run(run_upstream())
        return 0
    if args.mode in ("relay", "relay-io"):
        run_relay(args.port, socket_io=args.mode == "relay-io")
        return 0
    if args.mode == "pump":
        run_pump(args.port)
        return 0
    if args.mode == "httptools":
        run_httptools_relay(args.port)
        return 0
    args.wrk = None if args.no_wrk else shutil.which("wrk")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
