#!/usr/bin/env python3
"""Record the engines' context-length answers and llama-cpp-python's detection reads.

Starts, from the end-to-end cache (``e2e/prepare.py``), with the Gemma 3
270M model on 127.0.0.1:

- llama-server with ``--ctx-size 256``, and sends it a chat whose prompt is
  longer than that, unstreamed and streamed: its ``400`` answer goes to
  ``llama-server/context-exceeded.json`` (both must be the same ``400``);
- llama-cpp-python's server with its default settings but ``--n_ctx 256``:
  its ``GET /v1/models``, ``GET /openapi.json``, ``GET /health`` and
  ``GET /props`` answers, and its answer to the same long prompt, go to
  ``llama-cpp-python/``.

``llama-server/context-answers.json`` and ``llama-cpp-python/answers.json``
hold the commands, versions, statuses and content types. Stops every server
however it ends. Standard library only; run it with any Python 3.11+:

    python tests/data/engines/record_context_and_detection.py
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CACHE = Path(
    os.environ.get("TRIO_FAILOVER_E2E_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trio-failover-e2e"
)
HOST = "127.0.0.1"
CONTEXT = 256
# Some 14 tokens a line: 40 lines are well over 256 tokens.
PROMPT = "Summarise the following log. " + " ".join(
    f"line {n}: the lighthouse lamp was checked and found working." for n in range(40)
)
UUID = "3f2b8c1e-9d4a-4e7b-8c6f-1a2b3c4d5e6f"  # llama-cpp-python refuses other ids


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def exchange(
    port: int, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        headers = {"x-request-id": UUID}
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["content-type"] = "application/json"
        conn.request(method, path, data, headers)
        response = conn.getresponse()
        return response.status, response.getheader("content-type") or "", response.read()
    finally:
        conn.close()


def chat(stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "stream": stream,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": PROMPT}],
    }


def wait_ready(port: int, path: str, what: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if exchange(port, "GET", path)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def save(
    folder: Path, name: str, answer: tuple[int, str, bytes], index: dict[str, Any], **more: Any
) -> None:
    status, content_type, body = answer
    (folder / name).write_bytes(body)
    index[name] = {"status": status, "content_type": content_type, **more}


def run(argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def llama_server(manifest: dict[str, Any]) -> dict[str, Any]:
    server = manifest["llama_server"]
    port = free_port()
    argv = [server["binary"], "-m", manifest["model"]["file"], "--host", HOST, "--port", str(port)]
    argv += ["--threads", "1", "--threads-batch", "1", "--parallel", "1"]
    argv += [
        "--ctx-size",
        str(CONTEXT),
        "--no-jinja",
        "--chat-template",
        "gemma",
        "--alias",
        "tiny",
    ]
    env = dict(os.environ, LD_LIBRARY_PATH=server["lib_dir"])
    version = subprocess.run(
        [server["binary"], "--version"], env=env, capture_output=True, text=True, check=False
    )
    index: dict[str, Any] = {
        "llama_server_version": (version.stdout + version.stderr).strip(),
        "command": [Path(argv[0]).name, "-m", Path(argv[2]).name, *argv[3:]],
        "answers": {},
    }
    process = run(argv, env, "/tmp/record-context-llama-server.log")
    try:
        wait_ready(port, "/health", "llama-server")
        unstreamed = exchange(port, "POST", "/v1/chat/completions", chat(False))
        streamed = exchange(port, "POST", "/v1/chat/completions", chat(True))
        save(
            HERE / "llama-server",
            "context-exceeded.json",
            unstreamed,
            index["answers"],
            request="POST /v1/chat/completions, stream false, a prompt over --ctx-size",
        )
        index["answers"]["streamed"] = {
            "status": streamed[0],
            "content_type": streamed[1],
            "same_body_but_token_counts": _same(unstreamed[2], streamed[2]),
        }
    finally:
        stop(process)
    return index


def _same(one: bytes, two: bytes) -> bool:
    """Whether two error bodies differ at most in their numbers."""
    first, second = json.loads(one)["error"], json.loads(two)["error"]
    return (first["type"], first["code"]) == (second["type"], second["code"])


def llama_cpp_python(manifest: dict[str, Any]) -> dict[str, Any]:
    engine = manifest["llama_cpp_python"]
    port = free_port()
    argv = [engine["python"], "-m", "llama_cpp.server", "--model", manifest["model"]["file"]]
    argv += ["--model_alias", "tiny", "--host", HOST, "--port", str(port)]
    argv += ["--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", str(CONTEXT)]
    argv += ["--chat_format", "gemma"]
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        LLAMA_CPP_LIB_PATH=engine["lib_dir"],
        LD_LIBRARY_PATH=engine["lib_dir"],
    )
    folder = HERE / "llama-cpp-python"
    folder.mkdir(exist_ok=True)
    index: dict[str, Any] = {
        "llama_cpp_python_version": engine["version"],
        "command": ["python", "-m", "llama_cpp.server", "--model", Path(argv[4]).name, *argv[5:]],
        "answers": {},
    }
    process = run(argv, env, "/tmp/record-context-llama-cpp-python.log")
    try:
        wait_ready(port, "/v1/models", "llama-cpp-python")
        answers = index["answers"]
        for name, path in [
            ("v1-models.json", "/v1/models"),
            ("openapi.json", "/openapi.json"),
            ("health.json", "/health"),
            ("props.json", "/props"),
        ]:
            save(folder, name, exchange(port, "GET", path), answers, path=path)
        long = exchange(port, "POST", "/v1/chat/completions", chat(False))
        save(
            folder,
            "context-exceeded.json",
            long,
            answers,
            request="POST /v1/chat/completions, stream false, a prompt over --n_ctx",
        )
    finally:
        stop(process)
    (folder / "answers.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def main() -> None:
    manifest = json.loads((CACHE / "manifest.json").read_text())
    server = llama_server(manifest)
    (HERE / "llama-server" / "context-answers.json").write_text(json.dumps(server, indent=2) + "\n")
    python = llama_cpp_python(manifest)
    print(json.dumps({"llama-server": server, "llama-cpp-python": python}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
