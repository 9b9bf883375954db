"""Processes and clients of the end-to-end suite.

Real engines and the real proxy run as child processes, each in its own
process group with its output in a log file, so that ``stop()`` ends the
whole group whatever state it is in (a SIGSTOPped engine included). The
client speaks HTTP/1.1 over a plain socket, one connection per exchange, and
timestamps every read: the suite measures the proxy, it must not hide
buffering behind a library. Every wait is bounded. Traffic goes to
127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11

LOOPBACK = "127.0.0.1"
END_TOKENS = ("1", "106")  # <eos> and <end_of_turn> of Gemma 3
CHAT = "/v1/chat/completions"
# Tokens of context an engine gets, per slot, unless a test asks for more.
# Not more for llama-cpp-python: its server keeps the logits of every token
# (logits_all is on by default), n_ctx rows of 262,144 floats, 4 GiB at 4,096.
CONTEXT = 4096


class HarnessError(AssertionError):
    """A process or an exchange of the suite did not behave."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def request_id() -> str:
    """A client-chosen id that every engine accepts (llama-cpp-python wants a UUID)."""
    return str(uuid.uuid4())


def wait_for(predicate: Any, timeout: float, interval: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something true, for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise HarnessError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


# -- processes ----------------------------------------------------------------------------------


class Process:
    """A child in its own process group, stdout and stderr in ``log_path``."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        os.killpg(self.popen.pid, signum)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the process, all its threads."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, grace: float = 5.0) -> None:
        """End the whole group: SIGCONT (it may be stopped), SIGTERM, then SIGKILL."""
        try:
            if self.alive():
                self._group(signal.SIGCONT)
                self._group(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(grace)
            self._group(signal.SIGKILL)
            self.popen.wait(5)
        finally:
            self._log.close()

    def _group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signum)


@dataclass
class Manifest:
    """Where e2e/prepare.py put the engines and the model."""

    data: dict[str, Any]

    @property
    def model(self) -> str:
        return str(self.data["model"]["file"])


class Engine(Process):
    """One inference engine on a loopback port."""

    kind = ""

    def __init__(self, name: str, argv: list[str], log_path: Path, port: int, env: dict[str, str]):
        super().__init__(name, argv, log_path, env)
        self.port = port
        self.url = f"http://{LOOPBACK}:{port}"

    def ready(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout: float = 120.0) -> None:
        def check() -> bool:
            if not self.alive():
                raise HarnessError(f"{self.name} exited:\n{self.log_tail()}")
            try:
                return self.ready()
            except OSError:
                return False

        wait_for(check, timeout, interval=0.1, what=f"{self.name} to load its model")

    def busy(self) -> bool:
        """Whether the engine is working on a request now."""
        raise NotImplementedError


class LlamaServer(Engine):
    """llama.cpp's own server (C++, cpp-httplib)."""

    kind = "llama-server"

    @classmethod
    def start(
        cls,
        manifest: Manifest,
        name: str,
        log_dir: Path,
        *,
        alias: str = "tiny",
        parallel: int = 1,
        ctx_size: int = CONTEXT,
    ) -> LlamaServer:
        """Start it; ``ctx_size``: each slot's context (``--ctx-size`` is it times ``parallel``)."""
        port = free_port()
        server = manifest.data["llama_server"]
        argv = [server["binary"], "-m", manifest.model, "--host", LOOPBACK, "--port", str(port)]
        argv += ["--threads", "1", "--threads-batch", "1", "--parallel", str(parallel)]
        argv += ["--ctx-size", str(ctx_size * parallel), "--no-jinja", "--chat-template", "gemma"]
        argv += ["--alias", alias, "--slots", "--metrics"]
        env = dict(os.environ, LD_LIBRARY_PATH=server["lib_dir"])
        return cls(name, argv, log_dir / f"{name}.log", port, env)

    def ready(self) -> bool:
        status, _, _ = http_get(self.port, "/health")
        return status == 200

    def slots(self) -> list[dict[str, Any]]:
        # It answers between two batches of its work: during a prefill that
        # can take seconds.
        status, _, body = http_get(self.port, "/slots", timeout=30)
        if status != 200:
            raise HarnessError(f"{self.name} /slots: {status} {body[:200]!r}")
        slots: list[dict[str, Any]] = json.loads(body)
        return slots

    def busy(self) -> bool:
        return any(slot["is_processing"] for slot in self.slots())

    def busy_slots(self) -> int:
        """Its slots at work now (``/slots``)."""
        return sum(1 for slot in self.slots() if slot["is_processing"])

    def deferred(self) -> float:
        """Requests waiting inside it for a slot (``/metrics``' ``requests_deferred``)."""
        status, _, body = http_get(self.port, "/metrics", timeout=30)
        if status != 200:
            raise HarnessError(f"{self.name} /metrics: {status} {body[:200]!r}")
        found = _DEFERRED.search(body)
        if found is None:
            raise HarnessError(f"{self.name} /metrics has no requests_deferred: {body[:400]!r}")
        return float(found[1])


_DEFERRED = re.compile(rb"^llamacpp:requests_deferred\s+(\S+)", re.MULTILINE)


class LlamaCppPython(Engine):
    """llama-cpp-python's server (FastAPI, uvicorn, sse-starlette)."""

    kind = "llama-cpp-python"

    @classmethod
    def start(
        cls,
        manifest: Manifest,
        name: str,
        log_dir: Path,
        *,
        alias: str = "tiny",
        parallel: int = 1,
        interrupt_requests: bool | None = False,
        ctx_size: int = CONTEXT,
    ) -> LlamaCppPython:
        """Start it; ``interrupt_requests`` None leaves the engine's own default (True)."""
        if parallel != 1:
            raise ValueError("llama-cpp-python serves one request at a time")
        port = free_port()
        python = manifest.data["llama_cpp_python"]["python"]
        argv = [python, "-m", "llama_cpp.server", "--model", manifest.model]
        argv += ["--model_alias", alias, "--host", LOOPBACK, "--port", str(port)]
        argv += ["--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", str(ctx_size)]
        # Without a template of its own the model needs gemma's; and a second
        # request must wait for the first, not interrupt it, or a proxy that
        # leaves abandoned work running would go unnoticed. A test of what
        # the engine does as users run it passes interrupt_requests=None.
        argv += ["--chat_format", "gemma"]
        if interrupt_requests is not None:
            argv += ["--interrupt_requests", str(interrupt_requests)]
        lib_dir = manifest.data["llama_cpp_python"]["lib_dir"]
        # The libllama of the llama-server build, from the same sources (prepare.py).
        env = dict(
            os.environ, PYTHONUNBUFFERED="1", LLAMA_CPP_LIB_PATH=lib_dir, LD_LIBRARY_PATH=lib_dir
        )
        return cls(name, argv, log_dir / f"{name}.log", port, env)

    def ready(self) -> bool:
        status, _, _ = http_get(self.port, "/v1/models", {"X-Request-Id": request_id()})
        return status == 200

    def busy(self) -> bool:
        """Busy while it burns CPU: sampled over 0.5 s."""
        before = self.cpu_seconds()
        time.sleep(0.5)
        return self.cpu_seconds() - before > 0.25

    def disconnects(self) -> int:
        """How often its log says that a client went away."""
        return self.log_text().count("Disconnected from client")


ENGINES: dict[str, type[LlamaServer] | type[LlamaCppPython]] = {
    LlamaServer.kind: LlamaServer,
    LlamaCppPython.kind: LlamaCppPython,
}

_LISTENING = re.compile(r"listening on http://[\d.]+:(\d+)")
_ADMIN = re.compile(r"admin on http://[\d.]+:(\d+)")


class Proxy(Process):
    """``trio-failover serve`` on loopback ports 0, the ports read from its log."""

    def __init__(self, argv: list[str], log_path: Path):
        super().__init__(log_path.stem, argv, log_path, dict(os.environ))
        self.port = 0
        self.admin_port = 0

    @classmethod
    def start(
        cls,
        program: Path,
        upstreams: list[tuple[str, str]],
        extra: list[str],
        log_dir: Path,
        log_name: str = "proxy",
    ) -> Proxy:
        """Start it; its output goes to ``log_dir/LOG_NAME.log``."""
        argv = [str(program), "serve", "--listen", f"{LOOPBACK}:0"]
        argv += ["--admin-listen", f"{LOOPBACK}:0", "--shutdown-timeout", "1s"]
        for name, url in upstreams:
            argv += ["--upstream", f"{name}={url}"]
        return cls(argv + extra, log_dir / f"{log_name}.log")

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ports() -> bool:
            text = self.log_text()
            listening, admin = _LISTENING.search(text), _ADMIN.search(text)
            if listening and admin:
                self.port, self.admin_port = int(listening[1]), int(admin[1])
                return True
            if not self.alive():
                raise HarnessError(
                    f"the proxy exited ({self.popen.returncode}):\n{self.log_tail()}"
                )
            return False

        wait_for(ports, timeout, what="the proxy's startup lines")

    def status(self) -> dict[str, Any]:
        code, _, body = http_get(self.admin_port, "/status")
        if code != 200:
            raise HarnessError(f"/status: {code} {body[:200]!r}")
        data: dict[str, Any] = json.loads(body)
        return data

    def node(self, name: str) -> dict[str, Any]:
        for node in self.status()["nodes"]:
            if node["name"] == name:
                return dict(node)
        raise HarnessError(f"no node {name} in /status")

    def wait_auto_capacity(self, names: tuple[str, ...], slots: int) -> int:
        """Until /status shows every node's capacity from its own ``/props``; ms it took."""
        started = time.monotonic()

        def all_auto() -> bool:
            nodes = {node["name"]: node for node in self.status()["nodes"]}
            return all(
                nodes[name]["capacity"] == slots
                and nodes[name]["capacity_source"].startswith("auto (")
                and nodes[name]["capacity_source"] != "auto (the engine gives none)"
                for name in names
            )

        wait_for(all_auto, 15, interval=0.1, what=f"capacity auto = {slots} on {names}")
        return round((time.monotonic() - started) * 1000)

    def workload(self, rid: str) -> dict[str, Any]:
        """The workload of request id ``rid`` in /status."""
        for workload in self.status()["workloads"]:
            if workload["id"] == rid:
                return dict(workload)
        raise HarnessError(f"no workload {rid} in /status")

    def last_request_checks(self, timeout: float = 5.0) -> int:
        """The ``checks=`` of the last access line (the liveness checks its request passed).

        Waits for the line, which the proxy writes as the request ends.
        """
        found: list[int] = []

        def written() -> bool:
            for line in reversed(self.log_text().splitlines()):
                if " request " in line and " checks=" in line:
                    found.append(int(line.rsplit(" checks=", 1)[1].split()[0]))
                    return True
            return False

        wait_for(written, timeout, what="the access line")
        return found[0]

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the admin ``/metrics`` (0 when the series has none yet)."""
        code, _, body = http_get(self.admin_port, "/metrics")
        if code != 200:
            raise HarnessError(f"/metrics: {code} {body[:200]!r}")
        wanted = sorted(f'{key}="{value}"' for key, value in labels.items())
        for line in body.decode().splitlines():
            series, _, value = line.rpartition(" ")
            found_name, _, found_labels = series.partition("{")
            if found_name == name and sorted(found_labels.rstrip("}").split(",")) == wanted:
                return float(value)
        return 0.0


# -- HTTP ---------------------------------------------------------------------------------------


def http_get(
    port: int, path: str, headers: dict[str, str] | None = None, timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def long_prompt(lines: int) -> str:
    """A prompt of about 14 tokens a line: a prefill of seconds on one thread."""
    return "Summarise the following log. " + " ".join(
        f"line {n}: the lighthouse lamp was checked and found working." for n in range(lines)
    )


def chat_body(
    max_tokens: int,
    *,
    stream: bool = True,
    prompt: str = "Tell me a long story about a lighthouse keeper.",
    endless: bool = True,
    model: str = "tiny",
) -> dict[str, Any]:
    """A chat request; ``endless`` forbids the end tokens so it runs to ``max_tokens``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if endless:
        body["logit_bias"] = {token: -100 for token in END_TOKENS}
    return body


@dataclass
class Event:
    """One SSE ``data:`` line and when the read that completed it returned."""

    at: float
    data: str

    def content(self) -> str:
        if self.data == "[DONE]":
            return ""
        choices = json.loads(self.data).get("choices") or [{}]
        delta = choices[0].get("delta") or {}
        return str(delta.get("content") or "")


# Every exchange's socket, so that a test that fails half-way leaves none
# open (the fleet closes them): the suite turns ResourceWarnings into errors.
_sockets: list[socket.socket] = []


def close_exchanges() -> None:
    """Close every exchange's socket (closing one twice is harmless)."""
    while _sockets:
        _sockets.pop().close()


@dataclass
class Exchange:
    """One request on its own connection, its answer read piece by piece."""

    port: int
    method: str
    path: str
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    timeout: float = 30.0
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    complete: bool = False
    truncated: bool = False
    started: float = 0.0
    head_at: float = 0.0
    ended_at: float = 0.0
    peeked: bytes = b""

    @classmethod
    def post(
        cls,
        port: int,
        path: str,
        payload: dict[str, Any],
        *,
        rid: str | None = "",
        timeout: float = 30.0,
    ) -> Exchange:
        """POST JSON; ``rid`` "" means a fresh UUID, None means no X-Request-Id."""
        headers = [("content-type", "application/json")]
        if rid is not None:
            headers.append(("x-request-id", rid or request_id()))
        exchange = cls(port, "POST", path, json.dumps(payload).encode(), headers, timeout)
        exchange.send()
        return exchange

    def send(self) -> None:
        self._sock = socket.create_connection((LOOPBACK, self.port), timeout=self.timeout)
        _sockets.append(self._sock)
        self._h11 = h11.Connection(h11.CLIENT)
        headers = [("host", f"{LOOPBACK}:{self.port}"), *self.headers]
        headers.append(("content-length", str(len(self.body))))
        data = self._h11.send(h11.Request(method=self.method, target=self.path, headers=headers))
        data += self._h11.send(h11.Data(data=self.body)) + self._h11.send(h11.EndOfMessage())
        self._sock.sendall(data)
        self.started = time.monotonic()
        self._deadline = self.started + self.timeout

    def _next(self) -> Any:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError:
                self.truncated = True  # the peer closed before the end of the message
                return None
            if event is not h11.NEED_DATA:
                return event
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise HarnessError(f"no answer within {self.timeout} s")
            self._sock.settimeout(remaining)
            try:
                data = self._sock.recv(65536)
            except ConnectionResetError:
                data = b""
            except TimeoutError as exc:
                raise HarnessError(f"no answer within {self.timeout} s") from exc
            self._h11.receive_data(data)

    def read_head(self) -> int:
        event = self._next()
        if not isinstance(event, h11.Response):
            raise HarnessError(f"no response head: {event!r}")
        self.head_at = time.monotonic() - self.started
        self.status = event.status_code
        self.response_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
        return self.status

    def read_chunk(self) -> bytes | None:
        """The next piece of body, or None at the end (clean or not)."""
        event = self._next()
        if isinstance(event, h11.Data):
            self.chunks.append((time.monotonic() - self.started, bytes(event.data)))
            return bytes(event.data)
        self.ended_at = time.monotonic() - self.started
        if isinstance(event, h11.EndOfMessage):
            self.complete = True
        elif event is not None and not isinstance(event, h11.ConnectionClosed):
            raise HarnessError(f"unexpected {event!r}")
        return None

    def read_all(self) -> Exchange:
        """Read to the end of the answer (clean or not), then close."""
        try:
            if not self.status:
                self.read_head()
            while self.read_chunk() is not None:
                pass
        finally:
            self.close()
        return self

    def read_events(self, count: int) -> list[Event]:
        """Read until ``count`` events with content have arrived (or the end)."""
        if not self.status:
            self.read_head()
        while sum(1 for event in self.events() if event.content()) < count:
            if self.read_chunk() is None:
                break
        return self.events()

    def nothing_yet(self) -> bool:
        """Whether not one byte of the answer has arrived (nor its end)."""
        self._sock.settimeout(0)
        try:
            self.peeked = self._sock.recv(64, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        finally:
            self._sock.settimeout(self.timeout)
        return False

    def close(self) -> None:
        """Leave: close the socket (a FIN, or a RST if answer bytes are unread)."""
        self._sock.close()

    @property
    def body_bytes(self) -> bytes:
        return b"".join(chunk for _, chunk in self.chunks)

    def events(self) -> list[Event]:
        events, pending = [], b""
        for at, chunk in self.chunks:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: "):
                    events.append(Event(at, line[6:].decode().strip()))
        return events

    def text(self) -> str:
        return "".join(event.content() for event in self.events())

    def json(self) -> Any:
        return json.loads(self.body_bytes)


def read_in_threads(streams: list[Exchange]) -> Callable[[], list[Exchange]]:
    """Read every stream to its end in a thread of its own; the result waits for all."""
    pool = ThreadPoolExecutor(len(streams))
    futures = [pool.submit(stream.read_all) for stream in streams]
    pool.shutdown(wait=False)

    def results() -> list[Exchange]:
        return [future.result(timeout=120) for future in futures]

    return results


def token_times(exchange: Exchange) -> tuple[float, list[float]]:
    """Time to first token and the gaps between tokens, in seconds."""
    times = [event.at for event in exchange.events() if event.content()]
    if not times:
        raise HarnessError("no token arrived")
    return times[0], [later - earlier for earlier, later in itertools.pairwise(times)]


# -- the engine's speed, measured in the test that needs it -------------------------------------
#
# A test that needs a generation or a prefill to last some seconds sizes it
# from what the engine does here and now, never from a speed assumed once:
# the suite must hold on a machine three times faster or slower than the one
# it was written on, and on one shared with other work. The probes start
# with words no test prompt starts with, so that the engines' prompt caches
# (llama-server's per slot, llama-cpp-python's last prompt) give a test's
# own prompt nothing but the chat template.

PROBE_TOKENS = 48
PROBE_LINES = 10
PROMPT_TOKENS_PER_LINE = 14  # of long_prompt, with Gemma 3's tokenizer (13.7 measured)


def seconds_per_token(port: int) -> float:
    """The time an engine takes per generated token, from a short stream straight to it."""
    _, gaps = token_times(_probe(port, chat_body(PROBE_TOKENS, prompt="Probe: count slowly.")))
    return sum(gaps) / len(gaps)


def seconds_per_prompt_line(port: int) -> float:
    """The time an engine takes to read one line of ``long_prompt``, from a probe straight to it.

    Its first token's time over the lines: a little more than the reading
    alone, and a longer prompt costs more per line (attention grows with
    it), so a prompt sized from it reads for at least as long as asked.
    """
    first, _ = token_times(_probe(port, chat_body(1, prompt="Probe: " + long_prompt(PROBE_LINES))))
    return first / PROBE_LINES


def _probe(port: int, body: dict[str, Any]) -> Exchange:
    probe = Exchange.post(port, CHAT, body, timeout=120).read_all()
    if probe.status != 200:
        raise HarnessError(f"a speed probe got {probe.status}: {probe.body_bytes[:300]!r}")
    return probe


def tokens_lasting(seconds: float, per_token: float, room: int) -> int:
    """``max_tokens`` for a generation of about ``seconds`` at ``per_token``, at most ``room``.

    ``room``: what the context leaves after the prompt. A machine so fast
    that the room binds gets a shorter generation, never a refused request.
    """
    return max(PROBE_TOKENS, min(room, math.ceil(seconds / per_token)))


def lines_lasting(seconds: float, per_line: float, room: int) -> int:
    """Lines of ``long_prompt`` for a prefill of about ``seconds``, within ``room`` tokens."""
    return max(PROBE_LINES, min(room // PROMPT_TOKENS_PER_LINE, math.ceil(seconds / per_line)))


# -- a recording relay --------------------------------------------------------------------------


class Tap:
    """A TCP relay in front of an engine that records the bytes each way.

    It reads no HTTP, so what it recorded is what the engine sent. When
    either side closes, it closes both, so a proxy that leaves still makes
    the engine see its client go.
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.requests: list[bytearray] = []  # what came in, per connection
        self.responses: list[bytearray] = []  # what the engine sent, per connection
        self._sockets: list[socket.socket] = []
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection((LOOPBACK, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            request, response = bytearray(), bytearray()
            self.requests.append(request)
            self.responses.append(response)
            thread = threading.Thread(
                target=self._pump, args=(client, upstream, request, response), daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _pump(
        self, client: socket.socket, upstream: socket.socket, up: bytearray, down: bytearray
    ) -> None:
        peers = {client: (upstream, up), upstream: (client, down)}
        try:
            while not self._stopping.is_set():
                readable, _, _ = select.select(list(peers), [], [], 0.2)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    other, record = peers[sock]
                    record += data
                    other.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._stopping.set()
        self.listener.close()
        for sock in self._sockets:
            sock.close()
        for thread in self._threads:
            thread.join(2)

    def saw(self, needle: bytes) -> bool:
        return any(needle in bytes(request) for request in self.requests)

    def response_with(self, needle: bytes) -> bytes:
        """What the engine sent on the first connection whose answer holds ``needle``.

        The proxy's health checks pass the tap too, on connections of their own.
        """
        return next((bytes(r) for r in self.responses if needle in r), b"")

    def bodies(self) -> Iterator[bytes]:
        """The bodies of the responses the engine sent, in order, de-chunked."""
        for raw in self.responses:
            parser = h11.Connection(h11.CLIENT)
            # The parser must know a request is outstanding to read answers.
            parser.send(
                h11.Request(
                    method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]
                )
            )
            parser.send(h11.EndOfMessage())
            parser.receive_data(bytes(raw))
            body = b""
            while True:
                event = parser.next_event()
                if isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    yield body
                    if parser.our_state is h11.MUST_CLOSE or parser.their_state is h11.MUST_CLOSE:
                        break
                    parser.start_next_cycle()
                    parser.send(
                        h11.Request(
                            method="POST",
                            target="/",
                            headers=[("host", "x"), ("content-length", "0")],
                        )
                    )
                    parser.send(h11.EndOfMessage())
                    body = b""
                elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                    break
