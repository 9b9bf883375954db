#!/usr/bin/env python3
"""Record llama-server's answers to the signal reads, into tests/data/engines/llama-server/.

Starts the llama-server of the end-to-end cache (``e2e/prepare.py``) with the
Gemma 3 270M model on 127.0.0.1 with ``--parallel 2``, and records its
``/props``, ``/slots``, ``/health``, ``/v1/models`` and ``/metrics`` idle,
then with one streamed generation running, then with two running and a
third deferred (and when the deferred one got its head and first token).
Stops the server however it ends. Standard library only; run it with any
Python 3.11+:

    python tests/data/engines/record_llama_server.py
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "llama-server"
CACHE = Path(
    os.environ.get("TRIO_FAILOVER_E2E_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trio-failover-e2e"
)
HOST = "127.0.0.1"
PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def get(port: int, path: str, timeout: float = 30.0) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.getheader("content-type") or "", response.read()
    finally:
        conn.close()


class Stream(threading.Thread):
    """One streamed chat completion; notes when its head and first data came."""

    def __init__(self, port: int, started: float) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.started = started
        self.head_s: float | None = None
        self.first_data_s: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        body = json.dumps(
            {
                "model": "tiny",
                "stream": True,
                "max_tokens": 3000,
                "ignore_eos": True,  # llama-server's own: the story never ends early
                "messages": [{"role": "user", "content": PROMPT}],
            }
        )
        conn = http.client.HTTPConnection(HOST, self.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            response = conn.getresponse()
            self.head_s = time.monotonic() - self.started
            while not self.stop.is_set():
                line = response.readline()
                if not line:
                    break
                if line.startswith(b"data:") and self.first_data_s is None:
                    self.first_data_s = time.monotonic() - self.started
        except OSError:
            pass
        finally:
            conn.close()  # the client leaves: llama-server stops the generation


def record(port: int, name: str, path: str, index: dict[str, Any]) -> Any:
    status, content_type, body = get(port, path)
    suffix = ".txt" if path == "/metrics" else ".json"
    (HERE / f"{name}{suffix}").write_bytes(body)
    index[f"{name}{suffix}"] = {"path": path, "status": status, "content_type": content_type}
    return json.loads(body) if suffix == ".json" else body.decode()


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def busy_slots(port: int) -> int:
    _, _, body = get(port, "/slots")
    return sum(bool(slot["is_processing"]) for slot in json.loads(body))


def main() -> None:
    manifest = json.loads((CACHE / "manifest.json").read_text())
    server = manifest["llama_server"]
    port = free_port()
    argv = [server["binary"], "-m", manifest["model"]["file"], "--host", HOST, "--port", str(port)]
    argv += ["--threads", "1", "--threads-batch", "1", "--parallel", "2", "--ctx-size", "8192"]
    argv += ["--no-jinja", "--chat-template", "gemma", "--alias", "tiny", "--slots", "--metrics"]
    env = dict(os.environ, LD_LIBRARY_PATH=server["lib_dir"])
    version = subprocess.run(
        [server["binary"], "--version"], env=env, capture_output=True, text=True, check=False
    )
    HERE.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {
        "llama_server_version": (version.stdout + version.stderr).strip(),
        "command": [Path(argv[0]).name, "-m", Path(argv[2]).name, *argv[3:]],
        "answers": {},
    }
    log = open("/tmp/record-llama-server.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    answers = index["answers"]
    try:
        loading: tuple[int, str, bytes] | None = None

        def healthy() -> bool:
            nonlocal loading
            try:
                status, content_type, body = get(port, "/health", timeout=5)
            except OSError:
                return False
            if status != 200 and loading is None:
                loading = (status, content_type, body)
            return status == 200

        wait_for(healthy, 120, "llama-server to load its model")
        if loading is not None:
            (HERE / "health-loading.json").write_bytes(loading[2])
            answers["health-loading.json"] = {
                "path": "/health",
                "status": loading[0],
                "content_type": loading[1],
            }
        for name, path in [
            ("props", "/props"),
            ("slots-idle", "/slots"),
            ("health", "/health"),
            ("v1-models", "/v1/models"),
            ("metrics-idle", "/metrics"),
        ]:
            record(port, name, path, answers)
        status, _, body = get(port, "/api/version")
        answers["api-version-404"] = {
            "path": "/api/version",
            "status": status,
            "body": body.decode(),
        }

        started = time.monotonic()
        one = Stream(port, started)
        one.start()
        wait_for(lambda: one.first_data_s is not None, 120, "the first token")
        record(port, "slots-busy", "/slots", answers)
        record(port, "props-busy", "/props", answers)
        record(port, "metrics-busy", "/metrics", answers)

        two, three = Stream(port, started), Stream(port, started)
        two.start()
        wait_for(lambda: two.first_data_s is not None, 120, "the second stream's first token")
        three.start()
        third_started = time.monotonic() - started
        time.sleep(5.0)  # the third waits for a slot (does its head come meanwhile?)
        record(port, "slots-full", "/slots", answers)
        record(port, "metrics-deferred", "/metrics", answers)
        third_head = three.head_s
        first_data_while_deferred = three.first_data_s
        one.stop.set()  # free a slot: the deferred one starts
        one_left = time.monotonic() - started
        wait_for(lambda: three.first_data_s is not None, 120, "the deferred stream's token")
        index["deferral"] = {
            "third_started_s_after_start": round(third_started, 3),
            "third_head_s_after_start_while_deferred": third_head and round(third_head, 3),
            "third_head_s_after_start": round(three.head_s or 0.0, 3),
            "third_first_data_while_two_ran": first_data_while_deferred,
            "third_first_data_s_after_start": round(three.first_data_s or 0.0, 3),
            "first_stream_told_to_leave_s_after_start": round(one_left, 3),
        }
        two.stop.set()
        three.stop.set()
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
    (HERE / "answers.json").write_text(json.dumps(index, indent=2) + "\n")
    print(json.dumps(index, indent=2))


if __name__ == "__main__":
    sys.exit(main())
