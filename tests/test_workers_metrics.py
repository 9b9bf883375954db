"""``--workers N``: one ``/metrics`` adds up every worker's (issue 40), with real processes
on real loopback: requests through the one listener, a fake node served on a socket of
this test, the first worker's admin listener scraped.

Another worker's counts reach the shared files within ``SHARE_INTERVAL``: each
``/metrics`` read waits for the sum wanted, polling, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RedisServer
from prometheus_client.parser import text_string_to_metric_families
from test_workers import LIMIT, Supervisor, http_get, metrics_dir, supervisor

from trio_failover.telemetry.metrics import Metrics
from trio_failover.testing import FakeNode, Fleet, HeldRequests, healthy, request_tcp

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")

Samples = list[tuple[str, dict[str, str], float]]
BODY = b'{"messages": []}'


async def scrape(admin: tuple[str, int]) -> Samples:
    answer = await http_get(admin, "/metrics")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for sample, have, value in samples
        if sample == name and labels.items() <= have.items()
    )


async def scrape_until(
    admin: tuple[str, int], want: Callable[[Samples], bool], *, polls: int = 400
) -> Samples:
    """``/metrics`` once ``want`` holds of it (another worker writes within a second)."""
    for _ in range(polls):  # bounded: the caller's fail_after, and this count
        samples = await scrape(admin)
        if want(samples):
            return samples
        await trio.sleep(0.025)
    raise AssertionError("/metrics never showed what was wanted")


async def send(client: tuple[str, int], count: int) -> None:
    """``count`` requests, each on a connection of its own (spread over the workers)."""
    for _ in range(count):
        response = await request_tcp(client, body=BODY)
        assert response is not None
        assert response.status == 200


async def status_until(
    admin: tuple[str, int], want: Callable[[dict[str, Any]], bool], *, polls: int = 400
) -> dict[str, Any]:
    """``/status`` once ``want`` holds of it (a replica counts the others at its heartbeat)."""
    for _ in range(polls):  # bounded: the caller's fail_after, and this count
        status: dict[str, Any] = json.loads(
            (await http_get(admin, "/status")).partition(b"\r\n\r\n")[2]
        )
        if want(status):
            return status
        await trio.sleep(0.025)
    raise AssertionError(f"/status never showed what was wanted: {status}")


async def usage_until(admin: tuple[str, int], requests: int, *, polls: int = 400) -> None:
    """``/usage`` once it counts ``requests`` requests of the one client (``anonymous``)."""
    clients: list[dict[str, Any]] = []
    for _ in range(polls):  # bounded: the caller's fail_after, and this count
        clients = json.loads((await http_get(admin, "/usage")).partition(b"\r\n\r\n")[2])["clients"]
        if [(c["client"], c["requests"]) for c in clients] == [("anonymous", requests)]:
            return
        await trio.sleep(0.025)
    raise AssertionError(f"/usage never counted {requests} requests: {clients}")


async def worker_pids(sup: Supervisor, after: int = 0) -> list[int]:
    return [await sup.worker_pid(0, after), await sup.worker_pid(1, after)]


async def test_metrics_add_up_every_workers_counts_a_dead_ones_too(
    redis_server: RedisServer,
) -> None:
    # A heartbeat each second: the replicas count one another within it.
    state = f"--state=redis://127.0.0.1:{redis_server.port}"
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(healthy())}) as fleet:
            node = await fleet.serve_tcp("a")
            options = (f"--upstream=a={node.url}", "--workers=2", state, "--lease-ttl=3s")
            async with supervisor(*options) as sup:
                client, admin = await sup.address("listening"), await sup.address("admin")
                pids = await worker_pids(sup)
                directory = metrics_dir(pids[1])
                assert metrics_dir(pids[0]) == directory
                assert stat.S_IMODE(directory.stat().st_mode) == 0o700  # the run's own

                await send(client, 20)
                attempts = "trio_failover_attempts_total"
                samples = await scrape_until(admin, lambda s: total(s, attempts) == 20)
                assert total(samples, attempts, node="a", outcome="completed") == 20
                assert total(samples, "trio_failover_workloads_total", state="completed") == 20
                assert total(samples, "trio_failover_commits_total", node="a") == 20
                assert total(samples, "trio_failover_time_to_head_seconds_count") == 20
                # Gauges are combined, not listed per worker.
                ready = [s for s in samples if s[0] == "trio_failover_node_state"]
                assert sorted((s[1]["state"], s[2]) for s in ready) == [
                    ("cooling", 0),
                    ("down", 0),
                    ("ready", 1),
                ]
                assert total(samples, "trio_failover_state_replicas") == 2
                assert total(samples, "trio_failover_build_info") == 1
                # GET /usage too counts every worker's requests (added up in Redis).
                await usage_until(admin, 20)

                # Worker 1 killed: its counts stay, its gauges go; its successor adds on.
                seen = len(sup.lines)
                os.kill(pids[1], signal.SIGKILL)
                await sup.worker_pid(1, after=seen)
                assert not list(directory.glob(f"gauge_live*_{pids[1]}.db"))
                assert list(directory.glob(f"counter_{pids[1]}.db"))
                await send(client, 4)
                await scrape_until(admin, lambda s: total(s, attempts) == 24)
                await usage_until(admin, 24)  # the killed worker's requests too

                # /status covers the fleet (the shared state's view) and lists the workers.
                status = await status_until(admin, lambda s: s["state"]["replicas"] == 2)
                assert [(w["index"], w["serving"]) for w in status["workers"]] == [
                    (0, True),
                    (1, True),
                ]

                sup.process.send_signal(signal.SIGTERM)
                assert await sup.process.wait() == 0
                assert not directory.exists()  # cleaned at exit


async def test_in_flight_adds_up_what_each_worker_holds(redis_server: RedisServer) -> None:
    state = f"--state=redis://127.0.0.1:{redis_server.port}"
    held = HeldRequests()
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(held.behaviour())}) as fleet:
            node = await fleet.serve_tcp("a")
            async with supervisor(f"--upstream=a={node.url}", "--workers=2", state) as sup:
                client, admin = await sup.address("listening"), await sup.address("admin")
                in_flight = "trio_failover_in_flight"
                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(send, client, 1)
                    await held.wait_for(lambda: held.now == 8)
                    await scrape_until(admin, lambda s: total(s, in_flight, node="a") == 8)
                    held.let_all_go()
                await scrape_until(admin, lambda s: total(s, in_flight, node="a") == 0)


async def test_one_worker_shares_nothing() -> None:
    with trio.fail_after(LIMIT):
        async with supervisor("--upstream=a=http://127.0.0.1:9") as sup:
            admin = await sup.address("admin")
            environ = Path(f"/proc/{sup.process.pid}/environ").read_bytes()  # noqa: ASYNC240
            assert b"PROMETHEUS_MULTIPROC_DIR=" not in environ
            samples = await scrape(admin)
            # The process's own registry: counters keep their _created series.
            assert any(name == "trio_failover_reloads_created" for name, _, _ in samples)
            sup.process.send_signal(signal.SIGTERM)
            assert await sup.process.wait() == 0


# -- in one process: what a worker writes to the shared files, and when ---------------------


def counted(metrics: Metrics) -> float:
    """What the child of ``attempts{a, completed}`` holds (the shared file's value)."""
    value: float = metrics.attempts.labels("a", "completed")._value.get()
    return value


def test_share_writes_each_read_gauges_reading_now() -> None:
    metrics = Metrics(["a"])
    queued, held = [3], [2]
    metrics.queue_length.set_function(lambda: queued[0])
    metrics.in_flight.labels("a").set_function(lambda: held[0])
    metrics.share()
    assert metrics.queue_length._value.get() == 3
    assert metrics.in_flight.labels("a")._value.get() == 2
    queued[0], held[0] = 0, 1
    metrics.share()
    assert (metrics.queue_length._value.get(), metrics.in_flight.labels("a")._value.get()) == (0, 1)


async def test_a_worker_shares_every_interval_and_once_more_when_it_stops(
    autojump_clock: trio.abc.Clock,
) -> None:
    metrics = Metrics(["a"])
    metrics.shared_in = "/the-supervisors-directory"  # share_in's doing in a worker
    async with trio.open_nursery() as nursery:
        nursery.start_soon(metrics.share_every, 1.0)
        await trio.sleep(0.5)
        metrics.attempt_ended("a", "completed")  # held: not in the file yet
        assert counted(metrics) == 0
        await trio.sleep(1.0)  # past the write at 1.0 (not at it: no tie to break)
        assert counted(metrics) == 1
        metrics.attempt_ended("a", "completed")
        nursery.cancel_scope.cancel()  # the proxy stops: the last write has it
    assert counted(metrics) == 2


async def test_a_proxy_that_shares_nothing_runs_no_writer() -> None:
    metrics = Metrics(["a"])
    assert metrics.shared_in is None
    with trio.move_on_after(0) as scope:  # returns at once, before any deadline
        await metrics.share_every()
    assert not scope.cancelled_caught
