"""The benchmark's own machinery relays what it should (the timings are not tested).

``make bench`` is a measurement tool and CI does not run it; these checks
keep its reference relays, whose figures docs/performance.md reasons from,
from quietly rotting: each answers the JSON request as the upstream does,
several times on one keep-alive connection; and the streaming part's load
generators time chunks and its report has a row per system.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def answers(bench: ModuleType, port: int, count: int) -> list[bytes]:
    """``count`` answers to the JSON request on one keep-alive connection."""
    results = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(count):
            sock.sendall(bench.json_request(port))
            data = b""
            while not data.endswith(bench.JSON_ANSWER):
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
            results.append(data)
    return results


@pytest.mark.parametrize("mode", ["relay", "relay-io", "pump"])
def test_reference_relay_answers_like_the_upstream(bench: ModuleType, mode: str) -> None:
    with bench.child("upstream") as ((upstream_port, _frozen), _):
        relay = bench.child(mode, str(upstream_port))
        with relay as ((port,), _):
            for answer in answers(bench, port, 3):
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head
                assert body == bench.JSON_ANSWER


def test_json_upstream_answers_checks_like_llama_server(bench: ModuleType) -> None:
    """The proxy's checks get llama-server's answers from the JSON upstream too:
    ``/health`` its status on a kept connection, a route it lacks a 404 and the end."""
    with (
        bench.child("upstream") as ((upstream_port, _frozen), _),
        socket.create_connection(("127.0.0.1", upstream_port), timeout=10) as sock,
    ):
        health = bench.bench_stream.HEALTH_ANSWER
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
        data = b""
        while len(data) < len(health):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert data == health
        sock.sendall(b"GET /api/tags HTTP/1.1\r\nHost: bench\r\n\r\n")
        data = b""
        for _ in range(100):  # a few reads; a stream instead would not end
            chunk = sock.recv(65536)
            if not chunk:  # the upstream closes after it
                break
            data += chunk
        assert data == bench.bench_stream.NOT_FOUND_ANSWER


def test_cpu_seconds_reads_this_process_and_nothing_for_no_pid(bench: ModuleType) -> None:
    assert bench.cpu_seconds(os.getpid()) > 0
    assert bench.cpu_seconds(None) is None


@pytest.mark.parametrize("mode", ["relay", "relay-io"])
def test_stream_generators_time_chunks_through_the_bare_relay(bench: ModuleType, mode: str) -> None:
    with (
        bench.child_stream_upstream() as (upstream_port, upstream_pid),
        bench.child(mode, str(upstream_port)) as ((port,), pid),
    ):
        step = bench.stream_step(port, pid, upstream_pid, 3, None, 0.2, 0.5)
    assert step.opened == 3
    assert step.broken == 0
    # Three streams at ten chunks a second for half a second, give or take a tick.
    assert 5 <= step.chunks <= 25, step
    assert 0 <= step.p50_ms <= step.p99_ms <= step.max_ms
    # /proc counts CPU in clock ticks (10 ms): fifteen chunks may cost less than one.
    assert step.cpu_us is not None
    assert step.cpu_us >= 0


def test_stream_part_prints_a_row_per_system(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(SCRIPT),
        "--only",
        "stream",
        "--stream-ladder",
        "5",
        "--stream-warmup",
        "0.2",
        "--stream-duration",
        "0.5",
        "--no-nginx",
        "--litellm",
        "",
    ]
    # A session of its own, so that on a timeout its children (upstreams,
    # relays, the proxy) go with it instead of living on as orphans.
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            out, _ = process.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, out
    rows = {line.split()[0] for line in out.splitlines() if re.match(r"\S.* +5 +\d+ ", line)}
    assert {"direct", "bare", "trio-failover"} <= rows, out
    assert "Largest N with p99 <= 25 ms" in out
