"""Fixtures shared by the test files."""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from leaks import PrintedLogs, capture_logs

from trio_failover.core.redis_url import RedisAddress


class LogRecords(logging.Handler):
    """Keeps every record of the ``trio_failover`` loggers.

    Attached to the package logger itself, so it works whatever a test did
    to propagation (``configure_logging`` turns it off, which blinds caplog).
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[logging.LogRecord]:
        """The records of exactly ``level``."""
        return [record for record in self.records if record.levelno == level]

    def messages(self, level: int) -> list[str]:
        """The messages of the records of exactly ``level``."""
        return [record.getMessage() for record in self.at(level)]


@pytest.fixture
def logged() -> Iterator[LogRecords]:
    """Every log record of the proxy during the test, at DEBUG and above."""
    handler = LogRecords()
    log = logging.getLogger("trio_failover")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
def printed_logs() -> Iterator[PrintedLogs]:
    """Every log record, raw and as both formats print it (``leaks.PrintedLogs``)."""
    with capture_logs() as logs:
        yield logs


# -- a real redis-server for the shared state's tests ------------------------------------

REDIS_SERVER = shutil.which("redis-server")
# In CI (.ci/run) the Redis tests must run, not skip.
REQUIRE_REDIS = os.environ.get("TRIO_FAILOVER_REQUIRE_REDIS", "") not in ("", "0")
REDIS_START_TIMEOUT = 10.0  # seconds for the server to say it is ready and answer PING


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, nothing saved; ``stop``/``start`` keep its port.

    The port: redis-server has no ``--port 0``, so a free one is found by
    binding 127.0.0.1:0 and closing it, and another is tried when the server
    then finds it taken (it exits before saying it is ready).
    """

    def __init__(self, directory: Path, *extra: str) -> None:
        self.directory = directory
        self.extra = extra
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log: list[bytes] = []
        self._drainer: threading.Thread | None = None

    @property
    def address(self) -> RedisAddress:
        return RedisAddress(host="127.0.0.1", port=self.port)

    def start(self) -> None:
        """Start (again); on the first start, on a free port."""
        assert REDIS_SERVER is not None
        assert self.process is None
        for _ in range(5):
            port = self.port or free_port()
            command = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            command += ["--appendonly", "no", "--dir", str(self.directory), *self.extra]
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if self._wait_ready(process):
                self.port, self.process = port, process
                self._ping()
                return
            process.wait(REDIS_START_TIMEOUT)
            assert process.stdout is not None
            process.stdout.close()
            if self.port or b"already in use" not in b"".join(self.log):
                break  # a restart must keep its port; any other failure is not a clash
        raise RuntimeError(f"redis-server did not start: {b''.join(self.log).decode()[-2000:]}")

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> bool:
        """Read the server's log until it is ready (True) or exits (False), bounded."""
        assert process.stdout is not None
        stdout = process.stdout
        deadline = time.monotonic() + REDIS_START_TIMEOUT
        seen = b""
        while (remaining := deadline - time.monotonic()) > 0:
            if not select.select([stdout], [], [], remaining)[0]:
                break
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                return False
            self.log.append(chunk)
            seen += chunk
            if b"Ready to accept connections" in seen:
                # Keep draining its log, so that a full pipe never stops it.
                self._drainer = threading.Thread(target=self._drain, args=(stdout,), daemon=True)
                self._drainer.start()
                return True
        process.kill()
        return False

    def _drain(self, stdout: IO[bytes]) -> None:
        while chunk := os.read(stdout.fileno(), 65536):
            self.log.append(chunk)

    def _ping(self) -> None:
        """The server answers (``+PONG``, or ``-NOAUTH`` when it wants a password)."""
        with socket.create_connection(("127.0.0.1", self.port), REDIS_START_TIMEOUT) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(100)[:1] in (b"+", b"-")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a bound); its port stays ours to reuse."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(REDIS_START_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(REDIS_START_TIMEOUT)
        if self._drainer is not None:
            self._drainer.join(REDIS_START_TIMEOUT)  # the log's end: the server has exited
        assert self.process.stdout is not None
        self.process.stdout.close()
        self.process = None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start real redis-servers (extra arguments: ``--requirepass``...); all stopped at the end.

    Without ``redis-server`` on PATH the test is skipped, unless
    ``TRIO_FAILOVER_REQUIRE_REDIS=1`` (``.ci/run``): then it fails.
    """
    if REDIS_SERVER is None:
        why = "redis-server is not on PATH (apt-get install -y redis-server)"
        if REQUIRE_REDIS:
            pytest.fail(f"TRIO_FAILOVER_REQUIRE_REDIS is set but {why}")
        pytest.skip(why)
    servers: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        directory = tmp_path / f"redis-{len(servers)}"
        directory.mkdir()
        server = RedisServer(directory, *extra)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(start_redis: Callable[..., RedisServer]) -> RedisServer:
    """A real redis-server of its own for the test (see ``start_redis``)."""
    return start_redis()
