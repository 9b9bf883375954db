"""scripts/bench_stream.c: the C load generators speak bench_stream.py's protocol.

Compiled with the system's ``cc`` into a temporary cache (skipped without
one); real processes over 127.0.0.1, every wait bounded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_bench_stream() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_stream", SCRIPTS / "bench_stream.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_stream() -> ModuleType:
    return load_bench_stream()


@pytest.fixture(scope="module")
def binary(bench_stream: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no cc on PATH: the benchmarks use bench_stream.py")
    path: Path = bench_stream.compile_c(cache=tmp_path_factory.mktemp("cache"))
    return path


def readline(process: subprocess.Popen[bytes], timeout: float = 15.0) -> str:
    """The process's next line of stdout, or a failure after ``timeout`` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no line from {process.args!r} within {timeout} s"
    return process.stdout.readline().decode()


def tell(process: subprocess.Popen[bytes], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line.encode() + b"\n")
    process.stdin.flush()


@contextlib.contextmanager
def running(command: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        yield process
    finally:
        process.kill()
        process.wait(10)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def upstream_port(binary: Path) -> Iterator[int]:
    with running([str(binary), "upstream"]) as upstream:
        yield int(readline(upstream))


def read_until(sock: socket.socket, marker: bytes, count: int, timeout: float = 10.0) -> bytes:
    """Bytes from ``sock`` until ``marker`` has come ``count`` times."""
    data = b""
    deadline = time.monotonic() + timeout
    while data.count(marker) < count:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        piece = sock.recv(65536)
        assert piece, f"closed after {data!r}"
        assert time.monotonic() < deadline, f"{marker!r} x{count} not in {data!r}"
        data += piece
    return data


def test_clients_count_the_upstreams_chunks(binary: Path, upstream_port: int) -> None:
    """``open N``, ``go``, ``stop``: the result line, with the chunks counted and timed."""
    with running([str(binary), "clients", str(upstream_port), "5"]) as clients:
        assert readline(clients).split() == ["open", "5"]
        tell(clients, "go")
        # The measurement window itself (a stream's event comes every 100 ms),
        # not a wait for something to happen.
        time.sleep(0.5)
        tell(clients, "stop")
        fields = readline(clients).split()
        assert clients.wait(10) == 0
    assert len(fields) == 7  # chunks p50 p99 max cpu elapsed broken
    chunks, p50, p99, top = int(fields[0]), *map(float, fields[1:4])
    cpu, elapsed, broken = float(fields[4]), float(fields[5]), int(fields[6])
    assert abs(chunks - 5 * 10 * elapsed) <= 2 * 5  # 10 a second per stream
    assert 0 <= p50 <= p99 <= top < 1000  # delays in ms from a sane stamp
    assert 0 <= cpu < elapsed
    assert 0.45 <= elapsed < 5, fields  # go and stop are read up to a nap late
    assert broken == 0


def test_a_stamp_split_between_reads_is_counted_once(
    bench_stream: ModuleType, binary: Path
) -> None:
    """A fake upstream sends the measured event in two writes, cut inside its stamp."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        port = listener.getsockname()[1]
        with running([str(binary), "clients", str(port), "1"]) as clients:
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                read_until(conn, b"\r\n\r\n", 1)
                conn.sendall(bench_stream.STREAM_HEAD + bench_stream.event())
                assert readline(clients).split() == ["open", "1"]
                tell(clients, "go")
                event = bench_stream.event()
                cut = event.index(b"t=") + 6
                conn.sendall(event[:cut])
                # Apart in time, so that the client reads the halves separately.
                time.sleep(0.05)
                conn.sendall(event[cut:])
                # On loopback the second half is in the client's socket once
                # sendall returns: it is read in the same wakeup as "stop".
                tell(clients, "stop")
                fields = readline(clients).split()
    assert int(fields[0]) == 1
    assert 50 <= float(fields[2]) < 1000  # its delay counts the pause
    assert fields[6] == "0"


def test_finite_streams_keep_the_connection(bench_stream: ModuleType, upstream_port: int) -> None:
    """``"max_tokens":K``: K events and the body's end, then the next request on the
    same connection; the stamps are the ones bench_stream.py's STAMP reads."""
    body = b'{"model":"bench","max_tokens": 2,"stream":true}'
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Length: %d\r\n\r\n"
    request %= len(body)
    with socket.create_connection(("127.0.0.1", upstream_port), timeout=10) as sock:
        sock.sendall(request[:30])  # a head and body in pieces
        sock.sendall(request[30:] + body[:10])
        sock.sendall(body[10:])
        first = read_until(sock, bench_stream.BODY_END, 1)
        sock.sendall(request + body)
        second = read_until(sock, bench_stream.BODY_END, 1)
    for answer in (first, second):
        assert answer.startswith(bench_stream.STREAM_HEAD)
        assert answer.endswith(b"\r\n" + bench_stream.BODY_END)
        stamps = [int(m.group(1)) for m in bench_stream.STAMP.finditer(answer)]
        assert len(stamps) == 2
        assert 0 < stamps[1] - stamps[0] < 1_000_000_000  # one slot's turn apart
        assert abs(time.monotonic_ns() - stamps[1]) < 10_000_000_000  # CLOCK_MONOTONIC


@pytest.fixture(params=["c", "python"])
def either_upstream(request: pytest.FixtureRequest) -> Iterator[int]:
    """The port of the C upstream, then of bench_stream.py's."""
    if request.param == "c":
        command = [str(request.getfixturevalue("binary")), "upstream"]
    else:
        command = [sys.executable, str(SCRIPTS / "bench_stream.py"), "upstream"]
    with running(command) as upstream:
        yield int(readline(upstream))


def read_whole(sock: socket.socket, expected: bytes, timeout: float = 10.0) -> bytes:
    """Bytes from ``sock`` until there are as many as in ``expected`` (or it closes)."""
    data = b""
    sock.settimeout(timeout)
    while len(data) < len(expected):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


def read_to_close(sock: socket.socket, limit: int = 4096, timeout: float = 10.0) -> bytes:
    """Bytes from ``sock`` until it closes: at most ``limit`` of them, within ``timeout``."""
    data = b""
    deadline = time.monotonic() + timeout
    while len(data) <= limit:
        assert time.monotonic() < deadline, f"still open after {data!r}"
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        piece = sock.recv(65536)
        if not piece:
            return data
        data += piece
    raise AssertionError(f"more than {limit} bytes and still open: {data[:200]!r}...")


def test_checks_are_answered_on_a_kept_connection(
    bench_stream: ModuleType, either_upstream: int
) -> None:
    """``/health`` and ``/v1/models`` get short answers, as llama-server's, not the
    stream, and the same connection then takes a completion."""
    body = b'{"model":"bench","max_tokens":1,"stream":true}'
    completion = b"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nContent-Length: %d\r\n\r\n%s"
    with socket.create_connection(("127.0.0.1", either_upstream), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
        assert read_whole(sock, bench_stream.HEALTH_ANSWER) == bench_stream.HEALTH_ANSWER
        sock.sendall(b"GET /v1/models?x=1 HTTP/1.1\r\nHost: bench\r\n\r\n")
        assert read_whole(sock, bench_stream.MODELS_ANSWER) == bench_stream.MODELS_ANSWER
        sock.sendall(completion % (len(body), body))
        answer = read_until(sock, bench_stream.BODY_END, 1)
    assert answer.startswith(bench_stream.STREAM_HEAD)
    assert len(list(bench_stream.STAMP.finditer(answer))) == 1
    assert bench_stream.HEALTH_ANSWER.endswith(b'\r\nContent-Length: 15\r\n\r\n{"status":"ok"}')


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET /api/tags",
        b"GET /props",
        b"GET /slots",
        b"GET /metrics",
        b"GET /",
        b"POST /health",
        b"GET /v1/chat/completions",
    ],
)
def test_other_routes_get_404_at_once(
    bench_stream: ModuleType, either_upstream: int, request_line: bytes
) -> None:
    """What the upstream does not serve gets llama-server's 404 and the connection's
    end, at once: never the endless stream a check would read to its limits."""
    with socket.create_connection(("127.0.0.1", either_upstream), timeout=10) as sock:
        sock.sendall(request_line + b" HTTP/1.1\r\nHost: bench\r\nContent-Length: 0\r\n\r\n")
        answer = read_to_close(sock)  # the upstream closes after it
    assert answer == bench_stream.NOT_FOUND_ANSWER
    assert answer.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert b"\r\nConnection: close\r\n" in answer


def test_choose_falls_back_to_python_without_cc(
    bench_stream: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    try:
        line = bench_stream.choose("auto")
        assert line.startswith("load generators: Python")
        assert "no cc on PATH" in line
        assert bench_stream.command("upstream")[:1] == [sys.executable]
        with pytest.raises(SystemExit, match="--generators c: no cc on PATH"):
            bench_stream.choose("c")
    finally:
        bench_stream.choose("python")


def test_a_build_goes_only_once_unused_for_a_day(
    bench_stream: ModuleType, binary: Path, tmp_path: Path
) -> None:
    """Another checkout's benchmark may be running its build: a fresh build keeps it."""
    cache = binary.parent
    two_days_ago = time.time() - 2 * 86400
    stale, recent = cache / "bench_stream-00000000000000aa", cache / "bench_stream-00000000000000bb"
    stale.write_bytes(b"")
    recent.write_bytes(b"")
    os.utime(stale, (two_days_ago, two_days_ago))
    os.utime(binary, (two_days_ago, two_days_ago))
    assert bench_stream.compile_c(cache=cache) == binary  # cached: used, so touched
    assert binary.stat().st_mtime > two_days_ago + 86400
    edited = tmp_path / "bench_stream.c"
    edited.write_bytes(bench_stream.C_SOURCE.read_bytes() + b"\n/* another checkout's */\n")
    built = bench_stream.compile_c(edited, cache=cache)
    assert built != binary
    assert built.exists()
    assert binary.exists()
    assert recent.exists()
    assert not stale.exists()
