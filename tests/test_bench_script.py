"""The benchmark's own machinery relays what it should (the timings are not tested).

``make bench`` is a measurement tool and CI does not run it; these checks
keep its reference relays, whose figures docs/performance.md reasons from,
from quietly rotting: each answers the JSON request as the upstream does,
several times on one keep-alive connection.
"""

from __future__ import annotations

import importlib.util
import os
import socket
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


@pytest.mark.parametrize("mode", ["relay", "pump"])
def test_reference_relay_answers_like_the_upstream(bench: ModuleType, mode: str) -> None:
    with bench.child("upstream") as ((upstream_port, _frozen), _):
        relay = bench.child(mode, str(upstream_port))
        with relay as ((port,), _):
            for answer in answers(bench, port, 3):
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head
                assert body == bench.JSON_ANSWER


def test_cpu_seconds_reads_this_process_and_nothing_for_no_pid(bench: ModuleType) -> None:
    assert bench.cpu_seconds(os.getpid()) > 0
    assert bench.cpu_seconds(None) is None
