"""The client process of ``bench_churn.py``: streams that end and are replaced.

    python scripts/bench_churn.py churn-clients PORT N CHUNKS   # via bench_churn.py

Plain ``selectors`` loop, non-blocking connects, standard library only (as
``bench_stream.py``'s clients), so that the client is never where a new
stream waits. Two modes, chosen by the first command on stdin:

- ``churn``: N streams, each asking for ``CHUNKS`` events (``"max_tokens"``
  in the request body; ``bench_stream.py``'s upstream honours it). The
  first N open over one second and ask for a random number between 1 and
  CHUNKS, so that their ends are spread evenly from the start; each stream
  that ends is replaced by a new one on a new connection at once. ``go`` starts the
  measured window, ``stop`` ends it and prints the figures.
- ``burst``: N streams opened at once from idle, CHUNKS events each, not
  replaced; the figures are printed when the last has ended (or after a
  time limit, the rest counted as lost).

Per stream the client times, on CLOCK_MONOTONIC (the clock of the
upstream's stamps): its start (just before ``connect``), the connect's end
(the kernel's handshake: a SYN dropped for a full accept queue shows here,
as a second or more), and its first event. The figures, on one line of
``key=value`` fields: first-byte (start to first event) p50/p99/max,
connect p99/max, chunk gap (between two events of one stream, as read) p99,
chunk delay (read time minus stamp) p99, chunks read, the window's
seconds, streams started, ended, lost (a connect error, or EOF or a reset
before the body's end), still waiting at the end, and the client's CPU
seconds. A stream still waiting for its first event when the window ends
counts with its age so far, so a stream stuck in a queue is not left out.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import selectors
import socket
import sys
import time

STAMP = b"t="
BODY_END = b"\r\n0\r\n\r\n"
BURST_LIMIT_S = 60.0
RAMP_S = 1.0
# A file to write each measured stream's times to (local port, start,
# connected, first event; ns), for matching with a proxy's own stamps.
TRACE = os.environ.get("BENCH_CHURN_TRACE")


def request(chunks: int) -> bytes:
    body = (
        b'{"model":"bench","messages":[{"role":"user","content":"Count."}],'
        b'"stream":true,"max_tokens":%d}' % chunks
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


class Stream:
    """One stream's socket and times (ns)."""

    __slots__ = ("connected", "first", "last", "payload", "sock", "started", "tail")

    def __init__(self, sock: socket.socket, payload: bytes, started: int) -> None:
        self.sock = sock
        self.payload = payload
        self.started = started
        self.connected = 0
        self.first = 0
        self.last = 0
        self.tail = b""


class Figures:
    """What the window saw."""

    def __init__(self) -> None:
        self.first_bytes: list[int] = []
        self.connects: list[int] = []
        self.gaps: list[int] = []
        self.delays: list[int] = []
        self.chunks = 0
        self.started = 0
        self.ended = 0
        self.lost = 0


class ChurnClients:
    """N streams through ``port``; ends replaced when ``replace`` is set."""

    def __init__(self, port: int, count: int, chunks: int) -> None:
        self.address = ("127.0.0.1", port)
        self.count = count
        self.chunks = chunks
        self.selector = selectors.DefaultSelector()
        self.streams: set[Stream] = set()
        self.replace = True
        self.counting = False
        self.figures = Figures()
        self.trace: list[tuple[int, int, int, int]] = []

    def start(self, chunks: int) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = Stream(sock, request(chunks), time.monotonic_ns())
        self.figures.started += self.counting
        code = sock.connect_ex(self.address)
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self.lose()
            return
        self.streams.add(stream)
        self.selector.register(sock, selectors.EVENT_WRITE, stream)

    def lose(self) -> None:
        self.figures.lost += self.counting
        if self.replace:
            self.start(self.chunks)

    def end(self, stream: Stream, lost: bool) -> None:
        self.selector.unregister(stream.sock)
        stream.sock.close()
        self.streams.discard(stream)
        if lost:
            self.lose()
            return
        self.figures.ended += self.counting
        if self.replace:
            self.start(self.chunks)

    def connected(self, stream: Stream) -> None:
        if stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.end(stream, lost=True)
            return
        stream.connected = time.monotonic_ns()
        if self.counting:
            self.figures.connects.append(stream.connected - stream.started)
        try:
            stream.sock.send(stream.payload)
        except OSError:
            self.end(stream, lost=True)
            return
        self.selector.modify(stream.sock, selectors.EVENT_READ, stream)

    def readable(self, stream: Stream) -> None:
        try:
            data = stream.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        received = time.monotonic_ns()
        if not data:
            self.end(stream, lost=True)
            return
        data = stream.tail + data
        figures = self.figures
        at = data.find(STAMP)
        end = 0
        while at >= 0:
            close = data.find(b";", at)
            if close < 0:
                break
            stamp = int(data[at + 2 : close])
            end = close
            if not stream.first:
                stream.first = received
                if self.counting:
                    figures.first_bytes.append(received - stream.started)
                if TRACE and self.counting:
                    port = stream.sock.getsockname()[1]
                    self.trace.append((port, stream.started, stream.connected, received))
            elif self.counting:
                figures.gaps.append(received - stream.last)
            if self.counting:
                figures.chunks += 1
                figures.delays.append(received - stamp)
            stream.last = received
            at = data.find(STAMP, close)
        if data.endswith(BODY_END):
            self.end(stream, lost=False)
            return
        stream.tail = data[max(end, len(data) - 40) :]

    def poll(self, timeout: float) -> bool:
        """Serve what is ready; True if a command waits on stdin."""
        command = False
        for key, events in self.selector.select(timeout):
            if key.data is None:
                command = True
            elif events & selectors.EVENT_WRITE:
                self.connected(key.data)
            else:
                self.readable(key.data)
        return command

    def waiting(self, now: int) -> list[int]:
        """Ages of the streams still without their first event."""
        return [now - stream.started for stream in self.streams if not stream.first]


def percentile(values: list[int], q: float) -> float:
    """The ``q`` quantile in ms (nearest rank); -1 for none."""
    if not values:
        return -1.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


def summary(clients: ChurnClients, seconds: float, cpu: float) -> str:
    figures = clients.figures
    if TRACE:
        with open(TRACE, "w") as trace:
            trace.writelines(" ".join(map(str, times)) + "\n" for times in clients.trace)
    pending = clients.waiting(time.monotonic_ns())
    first = figures.first_bytes + pending
    fields = {
        "first_p50": percentile(first, 0.5),
        "first_p99": percentile(first, 0.99),
        "first_max": percentile(first, 1.0),
        "connect_p99": percentile(figures.connects, 0.99),
        "connect_max": percentile(figures.connects, 1.0),
        "gap_p99": percentile(figures.gaps, 0.99),
        "delay_p99": percentile(figures.delays, 0.99),
        "chunks": figures.chunks,
        "seconds": seconds,
        "started": figures.started,
        "ended": figures.ended,
        "lost": figures.lost,
        "waiting": len(pending),
        "cpu": cpu,
    }
    return " ".join(
        f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
        for key, value in fields.items()
    )


def cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def command(clients: ChurnClients, limit: float | None = None) -> str:
    """Serve the streams until a line arrives on stdin (or ``limit`` s pass: "")."""
    stdin = sys.stdin.fileno()
    clients.selector.register(stdin, selectors.EVENT_READ, None)
    deadline = None if limit is None else time.monotonic() + limit
    try:
        while not clients.poll(0.2):
            if deadline is not None and time.monotonic() > deadline:
                return ""
        return sys.stdin.readline().strip()
    finally:
        clients.selector.unregister(stdin)


def run_churn(clients: ChurnClients) -> None:
    # The first N open over RAMP_S (their own burst is the other scenario),
    # with lengths spread so that their ends, and so the new streams, come
    # evenly from the start.
    chunks, began, opened = clients.chunks, time.monotonic(), 0
    while opened < clients.count:
        due = min(clients.count, int(clients.count * (time.monotonic() - began) / RAMP_S) + 1)
        for _ in range(due - opened):
            clients.start(random.randint(1, chunks))
        opened = due
        clients.poll(0.01)
    if command(clients) != "go":
        return
    clients.counting, cpu, began = True, cpu_now(), time.monotonic()
    command(clients)  # "stop"
    print(summary(clients, time.monotonic() - began, cpu_now() - cpu), flush=True)


def run_burst(clients: ChurnClients) -> None:
    clients.replace, clients.counting = False, True
    cpu, began = cpu_now(), time.monotonic()
    for _ in range(clients.count):
        clients.start(clients.chunks)
    deadline = began + BURST_LIMIT_S
    while clients.streams and time.monotonic() < deadline:
        clients.poll(0.2)
    seconds = time.monotonic() - began
    line = summary(clients, seconds, cpu_now() - cpu)
    print(line + f" unfinished={len(clients.streams)}", flush=True)


def main(argv: list[str]) -> int:
    port, count, chunks = (int(arg) for arg in argv)
    clients = ChurnClients(port, count, chunks)
    mode = sys.stdin.readline().strip()
    if mode == "churn":
        run_churn(clients)
    elif mode == "burst":
        run_burst(clients)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
