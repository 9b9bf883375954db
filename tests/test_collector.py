"""The serving process's collector (service/collector.py, issue 33): what run_server sets."""

from __future__ import annotations

import gc
import io
import logging
from collections.abc import Iterator

import pytest

from trio_failover.core.config import Config, Upstream
from trio_failover.service import collector, server
from trio_failover.telemetry.logs import BatchedStreamHandler


@pytest.fixture
def restored() -> Iterator[None]:
    """The test process's collector as it was, afterwards."""
    thresholds = gc.get_threshold()
    flags = (logging.logProcesses, logging.logThreads, logging.logMultiprocessing)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        logging.logProcesses, logging.logThreads, logging.logMultiprocessing = flags


def test_the_oldest_generation_is_collected_a_tenth_as_often_the_start_frozen(
    restored: None,
) -> None:
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    gc.unfreeze()
    collector.tune_collector()
    assert gc.get_threshold() == (700, 10, collector.OLDEST_EVERY)
    assert collector.OLDEST_EVERY == 100
    assert gc.get_freeze_count() > 0  # the modules, settings and the like: never walked again


def test_run_server_tunes_its_process_before_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, restored: None
) -> None:
    class Stop(Exception):
        pass

    calls: list[str] = []
    monkeypatch.setattr(
        server, "configure_logging", lambda *a, **k: BatchedStreamHandler(io.StringIO())
    )
    monkeypatch.setattr(server, "tune_collector", lambda: calls.append("tuned"))

    def run(*args: object) -> int:
        calls.append("run")
        raise Stop

    monkeypatch.setattr(server, "_run_flushing", run)
    with pytest.raises(Stop):
        server.run_server(Config(upstreams=[Upstream("a", "http://127.0.0.1:9")]))
    assert calls == ["tuned", "run"]  # before the event loop starts
