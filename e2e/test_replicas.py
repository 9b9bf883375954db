"""Scenario 9: two replicas sharing one Redis in front of two single-slot llama-servers (issue 31).

Two ``trio-failover serve --state redis://...`` processes, each given both
engines with ``--capacity 1``, and two ``llama-server --parallel 1``. Four
streams at once, two through each replica: two run, one on each engine,
and two wait, each in its own replica's queue, until a slot is freed
anywhere. Without the shared state each replica would count only its own
streams and let one of its two onto each engine: two at one engine, the
second deferred inside it (run the suite with ``--proxy-arg=--state
--proxy-arg=memory`` to see it fail).

While the streams run, the test reads each engine's ``/slots`` (busy
count) and ``/metrics`` (``llamacpp:requests_deferred``) again and again:
never more than one busy, nothing deferred. The Redis is Debian's
``redis-server``, started for the test on a free loopback port.
"""

from __future__ import annotations

import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import Fleet
from harness import (
    CONTEXT,
    LOOPBACK,
    Exchange,
    HarnessError,
    Process,
    Proxy,
    chat_body,
    free_port,
    request_id,
    seconds_per_token,
    token_times,
    tokens_lasting,
    wait_for,
)
from report import Report

CHAT = "/v1/chat/completions"
# How long each wave of two streams runs, at the engines' speed measured in
# the test: seconds, on any machine.
WAVE_S = 3.0
# A waiter's first token after the slot it waited for was freed: the wake
# and a prefill (70 ms measured, client to client); woken at the engines'
# next reading instead it was 0.4 to 1.4 s (up to the 2 s load interval).
# The engine's part grows on a slower machine: two tokens' time (the
# prompt's tail, then the first token) are added to the bound as measured.
AFTER_FREE_BOUND_MS = 500


class Redis(Process):
    """A ``redis-server`` on a loopback port, nothing saved."""

    def __init__(self, log_dir: Path):
        binary = shutil.which("redis-server")
        assert binary is not None
        self.port = free_port()
        argv = [binary, "--port", str(self.port), "--bind", LOOPBACK, "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(log_dir)]
        super().__init__("redis", argv, log_dir / "redis.log")
        self.url = f"redis://{LOOPBACK}:{self.port}"

    def answers(self) -> bool:
        if not self.alive():
            raise HarnessError(f"redis-server exited:\n{self.log_tail()}")
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture
def redis(fleet: Fleet, log_dir: Path) -> Redis:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install -y redis-server)")
    server = Redis(log_dir)
    fleet.processes.insert(0, server)  # stopped last, after the replicas
    wait_for(server.answers, 10, interval=0.05, what="redis-server to answer PING")
    return server


def joined(replica: Proxy) -> None:
    wait_for(
        lambda: "shared state: joined" in replica.log_text(),
        15,
        what=f"{replica.name} to join the shared state",
    )


def test_four_streams_through_two_replicas_never_two_at_one_engine(
    fleet: Fleet, report: Report, redis: Redis
) -> None:
    a, b = fleet.engines("llama-server", "a", "b")  # --parallel 1: one slot each
    per_token = seconds_per_token(a.port)
    stream_tokens = tokens_lasting(WAVE_S, per_token, CONTEXT - 64)
    after_free_bound = AFTER_FREE_BOUND_MS + 2 * per_token * 1000
    engines = [("a", a.url), ("b", b.url)]
    shared = ("--capacity", "1", "--state", redis.url)
    replicas = [fleet.proxy(engines, *shared), fleet.proxy(engines, *shared)]
    for replica in replicas:
        joined(replica)

    # Two streams through each replica, all four at once.
    through = [replicas[0], replicas[1], replicas[0], replicas[1]]
    streams = [
        Exchange.post(replica.port, CHAT, chat_body(stream_tokens), rid=request_id(), timeout=120)
        for replica in through
    ]
    pool = ThreadPoolExecutor(len(streams))
    futures: list[Future[Exchange]] = [pool.submit(stream.read_all) for stream in streams]
    pool.shutdown(wait=False)

    seen: dict[str, Any] = {"busy_a": 0, "busy_b": 0, "deferred": 0.0, "queued": 0, "reads": 0}
    started = time.monotonic()
    while not all(future.done() for future in futures):  # bounded: each stream's 120 s
        seen["busy_a"] = max(seen["busy_a"], a.busy_slots())
        seen["busy_b"] = max(seen["busy_b"], b.busy_slots())
        seen["deferred"] = max(seen["deferred"], a.deferred(), b.deferred())
        queued = sum(replica.status()["queued"] for replica in replicas)
        seen["queued"] = max(seen["queued"], queued)
        seen["reads"] += 1
        if time.monotonic() - started > 150:
            raise HarnessError(f"the streams did not end: {seen}")
        time.sleep(0.05)
    results = [future.result(timeout=1) for future in futures]

    for stream in results:
        assert stream.status == 200, stream.body_bytes[:300]
        assert stream.complete
        assert stream.events()[-1].data == "[DONE]"
    # Never two at one engine, nothing waiting inside one; two waited in the replicas.
    assert (seen["busy_a"], seen["busy_b"], seen["deferred"]) == (1, 1, 0), seen
    assert seen["queued"] == 2, seen
    nodes = [stream.response_headers["x-failover-node"] for stream in results]
    attempts = [stream.response_headers["x-failover-attempts"] for stream in results]
    assert sorted(nodes) == ["a", "a", "b", "b"], nodes
    assert attempts == ["1"] * 4, attempts
    first = [round(token_times(stream)[0] * 1000) for stream in results]
    ends = [round(stream.chunks[-1][0] * 1000) for stream in results]
    # The two that waited start as the first two end: their first token
    # comes a prefill after the end they waited for, not at the replica's
    # next reading of the engine's /slots (up to --load-interval, 2 s, later).
    order = sorted(range(4), key=first.__getitem__)
    ran, waited = order[:2], order[2:]
    after_free = [
        first[w] - end for w, end in zip(waited, sorted(ends[r] for r in ran), strict=True)
    ]
    assert max(after_free) < after_free_bound, (first, ends, after_free_bound)
    for replica in replicas:
        state = replica.status()["state"]
        assert (state["backend"], state["connected"]) == ("redis", True), state
    report.record(
        "9 four streams through two replicas (--state redis), two llama-server --parallel 1,"
        " --capacity 1",
        "llama-server",
        replicas="".join("12"[replicas.index(r)] for r in through),
        nodes="".join(nodes),
        first_token=first,
        ended=ends,
        waiters_first_token_after_free=after_free,
        reads=seen["reads"],
        stream_tokens=stream_tokens,
    )
