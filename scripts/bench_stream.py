"""The load generators of ``bench.py``'s streaming part: one upstream, one client process.

    python scripts/bench_stream.py upstream         # prints its port
    python scripts/bench_stream.py clients PORT N   # driven over stdin/stdout

Both are plain ``selectors`` loops over non-blocking sockets, with nothing
but the standard library, so that they cost a few microseconds per event and
the system under test runs out of CPU first (``bench.py`` reports their CPU
next to the proxy's, to show it).

The upstream answers like llama-server: ``GET /health`` gets ``200``
``{"status":"ok"}`` and ``GET /v1/models`` (or ``/models``) a one-model list,
both with a Content-Length on a kept-alive connection; a ``POST`` to a path
ending in ``/completions`` (or to ``/completion``) gets the stream; any other
request gets llama-server's ``404`` at once (``File Not Found``, a short JSON
body, ``Connection: close``), so a proxy's checks and discovery probes cost
what they cost at a real engine, not a read of an endless stream. The
stream is endless: the head and one event at once, then one event every
100 ms, from a single timer loop for every stream (a wheel of 100
one-millisecond slots, the streams spread over them, so the events go out
evenly rather than in bursts).
Each event is an OpenAI-style chunk of about 100 bytes whose content is
``t=NANOSECONDS;``: the CLOCK_MONOTONIC time (system-wide on Linux) just
before it was written, so a proxy that re-encodes chunks keeps the stamp.
A request whose body says ``"max_tokens":K`` gets a finite stream instead:
K events (the first with the head), then the chunked body's end, and the
connection stays open for the next request (``bench_churn.py`` uses it).

The client process opens N streams, then on ``go`` starts counting, and on
``stop`` prints what it saw since: chunks, the delay of each (its read time
minus its stamp) as p50/p99/max in ms, its own CPU seconds, and the streams
that broke. Then it exits.

``bench_stream.c`` is the same two generators in C, for a fraction of the
CPU (see docs/performance.md). Its clients wake at most once a millisecond
and take a read's time from the kernel's receive stamp, not the clock after
``recv``: the nap stays out of the delays. The benchmarks start whichever ``choose()``
picked (their ``--generators``): the C ones, compiled on first use with the
system's ``cc`` into a cache outside the checkout and rebuilt when the
source changes, or these, where there is no ``cc``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import resource
import selectors
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

PERIOD_NS = 100_000_000  # a token every 100 ms per stream
SLOTS = 100
SLOT_NS = PERIOD_NS // SLOTS
EVENT = (
    b'data: {"object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"t=%d;"}}]}\n\n'
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)
UNUSED_BUILD_SECONDS = 86400.0  # a cached build of another source, untouched this long, goes
MODELS = b'{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
HEALTH = b'{"status":"ok"}'
NOT_FOUND = b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'


def json_answer(status: bytes, body: bytes, *, close: bool = False) -> bytes:
    """A whole JSON answer with a Content-Length, as llama-server writes one."""
    head = b"HTTP/1.1 %s\r\nContent-Type: application/json; charset=utf-8\r\n" % status
    if close:
        head += b"Connection: close\r\n"
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


HEALTH_ANSWER = json_answer(b"200 OK", HEALTH)
MODELS_ANSWER = json_answer(b"200 OK", MODELS)
NOT_FOUND_ANSWER = json_answer(b"404 Not Found", NOT_FOUND, close=True)
REQUEST_BODY = b'{"model":"bench","messages":[{"role":"user","content":"Count."}],"stream":true}'
STAMP = re.compile(rb"t=(\d+);")
MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')
BODY_END = b"0\r\n\r\n"


def event() -> bytes:
    """One chunk of the chunked body: an SSE event stamped now."""
    data = EVENT % time.monotonic_ns()
    return b"%x\r\n%s\r\n" % (len(data), data)


def route(head: bytes) -> str:
    """What the upstream does with a request, by its head's method and path.

    ``"health"`` and ``"models"``: a short JSON answer, the connection kept;
    ``"stream"``: the event stream (a completion); ``"missing"``: llama-server's
    404 for a route it does not serve, and the connection closed.
    """
    method, _, rest = head.partition(b" ")
    path = rest.partition(b" ")[0].partition(b"?")[0]
    if method == b"GET" and path == b"/health":
        return "health"
    if method == b"GET" and path in (b"/v1/models", b"/models"):
        return "models"
    if method == b"POST" and (path.endswith(b"/completions") or path == b"/completion"):
        return "stream"
    return "missing"


def nodelay(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- the upstream -----------------------------------------------------------------------


class Upstream:
    """Every stream's events from one timer loop."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4096)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.requests: dict[socket.socket, bytes] = {}  # heads still arriving
        self.wheel: list[set[socket.socket]] = [set() for _ in range(SLOTS)]
        self.slot_of: dict[socket.socket, int] = {}
        self.left: dict[socket.socket, int] = {}  # events still to send, finite streams
        self.opened = 0

    def serve(self) -> None:
        tick_at = time.monotonic_ns() + SLOT_NS
        tick = 0
        while True:
            timeout = max(0, tick_at - time.monotonic_ns()) / 1e9
            for key, _ in self.selector.select(timeout):
                if key.fileobj is self.listener:
                    self.accept()
                else:
                    self.readable(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic_ns()
            while tick_at <= now:  # when late, catch up: every slot is served
                for sock in list(self.wheel[tick % SLOTS]):
                    self.tick(sock)
                tick += 1
                tick_at += SLOT_NS

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            nodelay(sock)
            self.requests[sock] = b""
            self.selector.register(sock, selectors.EVENT_READ)

    def readable(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(sock)
        elif sock in self.requests:
            self.request(sock, self.requests[sock] + data)

    def request(self, sock: socket.socket, data: bytes) -> None:
        head, sep, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        if not sep or (length and len(body) < int(length.group(1))):
            self.requests[sock] = data
            return
        del self.requests[sock]
        kind = route(head)
        if kind == "missing":
            self.send(sock, NOT_FOUND_ANSWER)
            self.close(sock)
            return
        if kind != "stream":  # anything after the request is not read, as after a stream
            self.requests[sock] = b""
            self.send(sock, HEALTH_ANSWER if kind == "health" else MODELS_ANSWER)
            return
        slot = self.opened % SLOTS
        self.opened += 1
        self.wheel[slot].add(sock)
        self.slot_of[sock] = slot
        tokens = MAX_TOKENS.search(body)
        if tokens:
            self.left[sock] = int(tokens.group(1))
        self.tick(sock, STREAM_HEAD)

    def tick(self, sock: socket.socket, head: bytes = b"") -> None:
        """The stream's next event; after a finite stream's last, the body's end."""
        left = self.left.get(sock)
        if left is None:
            self.send(sock, head + event())
        elif left > 1:
            self.left[sock] = left - 1
            self.send(sock, head + event())
        else:  # the last event and the end; then wait for the next request
            del self.left[sock]
            self.wheel[self.slot_of.pop(sock)].discard(sock)
            self.requests[sock] = b""
            self.send(sock, head + event() + BODY_END)

    def send(self, sock: socket.socket, data: bytes) -> None:
        # A full socket buffer means the reader stopped reading; a partial
        # write would break the chunked framing, so the stream ends there.
        try:
            if sock.send(data) == len(data):
                return
        except OSError:
            pass
        self.close(sock)

    def close(self, sock: socket.socket) -> None:
        if sock.fileno() < 0:
            return
        self.requests.pop(sock, None)
        self.left.pop(sock, None)
        slot = self.slot_of.pop(sock, None)
        if slot is not None:
            self.wheel[slot].discard(sock)
        self.selector.unregister(sock)
        sock.close()


def run_upstream() -> None:
    upstream = Upstream()
    print(upstream.listener.getsockname()[1], flush=True)
    upstream.serve()


# -- the clients ------------------------------------------------------------------------


class Clients:
    """N streams through ``port``, their chunks timed against their stamps."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.selector = selectors.DefaultSelector()
        self.tails: dict[socket.socket, bytes] = {}
        self.open: set[socket.socket] = set()  # has received its first event
        self.broken = 0
        self.delays: list[int] = []
        self.counting = False

    def connect(self, count: int) -> None:
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(REQUEST_BODY), REQUEST_BODY)
        )
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            nodelay(sock)
            sock.send(request)
            self.tails[sock] = b""
            self.selector.register(sock, selectors.EVENT_READ)

    def poll(self, timeout: float) -> bool:
        """Read what has arrived; True if a command is waiting on stdin."""
        command = False
        for key, _ in self.selector.select(timeout):
            if key.data == "stdin":
                command = True
                continue
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            received = time.monotonic_ns()  # before parsing: only transit counts
            if not data:
                self.broken += 1
                self.open.discard(sock)
                self.selector.unregister(sock)
                del self.tails[sock]
                sock.close()
                continue
            data = self.tails[sock] + data
            end = 0
            for match in STAMP.finditer(data):
                if self.counting:
                    self.delays.append(received - int(match.group(1)))
                end = match.end()
            if end:
                self.open.add(sock)
            # A stamp split between two reads is matched once whole.
            self.tails[sock] = data[max(end, len(data) - 40) :]
        return command

    def open_streams(self, count: int, limit: float) -> int:
        """Open ``count`` streams in batches of 100; how many delivered an event."""
        deadline = time.monotonic() + limit
        for start in range(0, count, 100):
            self.connect(min(100, count - start))
            while len(self.open) < start + min(100, count - start):
                if time.monotonic() > deadline:
                    return len(self.open)
                self.poll(0.05)
        return len(self.open)

    def run_until_line(self) -> str:
        """Relay-read every stream until a command arrives on stdin."""
        stdin = sys.stdin.fileno()
        self.selector.register(stdin, selectors.EVENT_READ, "stdin")
        try:
            while not self.poll(1.0):
                pass
            return sys.stdin.readline().strip()
        finally:
            self.selector.unregister(stdin)


def cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_clients(port: int, count: int) -> None:
    clients = Clients(port)
    opened = clients.open_streams(count, limit=30 + count / 50)
    print("open", opened, flush=True)
    if clients.run_until_line() != "go":
        return
    clients.counting, clients.broken, cpu = True, 0, cpu_now()
    began = time.monotonic()
    clients.run_until_line()  # "stop"
    elapsed, cpu = time.monotonic() - began, cpu_now() - cpu
    ordered = sorted(clients.delays)

    def ms(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6 if ordered else -1.0

    print(len(ordered), ms(0.5), ms(0.99), ms(1.0), cpu, elapsed, clients.broken, flush=True)


# -- which generators the benchmarks start ---------------------------------------------

C_SOURCE = Path(__file__).resolve().with_suffix(".c")
GENERATORS = ("auto", "c", "python")
_command = [sys.executable, str(Path(__file__).resolve())]  # what command() starts


def cache_dir() -> Path:
    """Where the compiled generators live: outside any checkout, shared by all of them."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trio-failover-bench"


def compile_c(source: Path = C_SOURCE, cache: Path | None = None) -> Path:
    """The C generators' binary, compiled with ``cc`` unless this source's is cached.

    The binary's name carries the source's hash, so an edited source is
    built again and two benchmarks compiling at once each rename a whole
    file into place; a build unused for ``UNUSED_BUILD_SECONDS`` is removed
    (each use touches it), so two checkouts can run theirs side by side.

    Raises:
        FileNotFoundError: no ``cc`` on PATH.
        RuntimeError: ``cc`` failed (its output in the message).
    """
    cc = shutil.which("cc")
    if cc is None:
        raise FileNotFoundError("no cc on PATH")
    cache = cache or cache_dir()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    binary = cache / f"bench_stream-{digest}"
    if binary.exists():
        binary.touch()  # in use: kept by other checkouts' clean-ups
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    building = cache / f".bench_stream-{digest}.{os.getpid()}"
    command = [cc, "-O2", "-Wall", "-Wextra", "-o", str(building), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        building.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
    building.replace(binary)
    # Other sources' builds go once unused for a day: another checkout's
    # benchmark may be running one now.
    stale = time.time() - UNUSED_BUILD_SECONDS
    for old in cache.glob("bench_stream-*"):
        with contextlib.suppress(FileNotFoundError):
            if old != binary and old.stat().st_mtime < stale:
                old.unlink()
    return binary


def add_generators_argument(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' ``--generators``: which load generators ``choose`` picks."""
    parser.add_argument(
        "--generators",
        choices=GENERATORS,
        default="auto",
        help="the streaming load generators: c (bench_stream.c, built with cc), python "
        "(bench_stream.py), or auto: c where cc builds it (default auto)",
    )


def choose(choice: str) -> str:
    """Make ``command()`` start the C generators or these; a line saying which.

    ``auto``: the C ones if they compile, else these. ``c``: the C ones or
    SystemExit. ``python``: these.
    """
    global _command
    python = [sys.executable, str(Path(__file__).resolve())]
    if choice == "python":
        _command = python
        return "load generators: Python (bench_stream.py), as asked"
    try:
        binary = compile_c()
    except (OSError, RuntimeError) as exc:
        if choice == "c":
            sys.exit(f"--generators c: {exc}")
        _command = python
        return f"load generators: Python (bench_stream.py); the C ones did not build: {exc}"
    _command = [str(binary)]
    return f"load generators: C (bench_stream.c, built as {binary})"


def command(*args: str) -> list[str]:
    """The command line of one generator: ``command("upstream")``,
    ``command("clients", port, n)``."""
    return [*_command, *args]


def main() -> int:
    if sys.argv[1:2] == ["upstream"]:
        run_upstream()
    elif sys.argv[1:2] == ["clients"]:
        run_clients(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
