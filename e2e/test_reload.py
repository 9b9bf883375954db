"""Scenario 9: a reload adds a real engine while a stream runs on the other (issue 32).

The proxy runs from a config file (``serve --config FILE``) that names one
engine; the test starts a stream there, writes the second engine into the
file, sends ``SIGHUP``, and waits for the ``reloaded`` line and for the new
node in ``/status``. The stream that ran through the reload must end as it
would have (every token, ``[DONE]``), and the next two streams, with a
capacity of 1 per node, must run one on each engine. The timings go to the
report (and docs/configuration.md).
"""

from __future__ import annotations

import itertools
import signal
import statistics
import time
from pathlib import Path

from conftest import PROGRAM, Fleet
from harness import (
    CONTEXT,
    LOOPBACK,
    Exchange,
    Proxy,
    chat_body,
    seconds_per_token,
    tokens_lasting,
    wait_for,
)
from report import Report

CHAT = "/v1/chat/completions"
RUNNING_S = 5.0  # the stream that runs through the reload, at the engine's measured speed


def _fleet_file(path: Path, nodes: list[tuple[str, str]], capacity: str = "1") -> None:
    """One ``[[upstream]]`` per node; ``capacity`` "" leaves it ``auto``."""
    line = f"capacity = {capacity}\n" if capacity else ""
    text = "".join(f'[[upstream]]\nname = "{n}"\nurl = "{u}"\n{line}\n' for n, u in nodes)
    path.write_text(text)


def _serve(fleet: Fleet, config: Path, log_dir: Path) -> Proxy:
    """``trio-failover serve --config FILE`` on loopback ports 0."""
    argv = [str(PROGRAM), "serve", "--config", str(config), "--listen", f"{LOOPBACK}:0"]
    argv += ["--admin-listen", f"{LOOPBACK}:0", "--shutdown-timeout", "1s", *fleet.proxy_args]
    proxy = Proxy(argv, log_dir / "proxy.log")
    fleet.processes.append(proxy)
    proxy.wait_ready()
    return proxy


def _reload(proxy: Proxy) -> float:
    """Send SIGHUP and wait for the ``reloaded`` line; returns when the signal went."""
    hup = time.monotonic()
    proxy.signal(signal.SIGHUP)
    wait_for(lambda: "reloaded" in proxy.log_text(), 10, what="the reloaded line")
    return hup


def test_sighup_adds_an_engine_while_a_stream_runs(
    fleet: Fleet, report: Report, log_dir: Path
) -> None:
    a, b = fleet.engines("llama-server", "a", "b")
    # A stream of some RUNNING_S at a's speed here, far longer than a reload
    # and b's first check (~0.1 s), on any machine.
    running_tokens = tokens_lasting(RUNNING_S, seconds_per_token(a.port), CONTEXT - 64)
    config = log_dir / "fleet.toml"
    _fleet_file(config, [("a", a.url)])
    proxy = _serve(fleet, config, log_dir)
    assert [node["name"] for node in proxy.status()["nodes"]] == ["a"]

    running = Exchange.post(proxy.port, CHAT, chat_body(running_tokens), timeout=120)
    read_before = sum(1 for event in running.read_events(4) if event.content())  # under way
    assert running.response_headers["x-failover-node"] == "a"

    _fleet_file(config, [("a", a.url), ("b", b.url)])
    hup = _reload(proxy)
    logged = time.monotonic() - hup
    assert "node b added" in proxy.log_text()
    wait_for(
        lambda: [node["name"] for node in proxy.status()["nodes"]] == ["a", "b"],
        10,
        what="b in /status",
    )
    wait_for(lambda: proxy.node("b")["models"], 20, what="b's models, found by discovery")
    discovered = time.monotonic() - hup
    # The engine's word, not the client's (which has read four tokens so far).
    assert a.busy(), "the stream should outlast the reload (make RUNNING_S longer)"

    running.read_all()
    assert running.status == 200
    assert running.complete
    assert running.events()[-1].data == "[DONE]"
    tokens = [event for event in running.events() if event.content()]
    # Endless: as many tokens as asked for; one lost shows.
    assert len(tokens) == running_tokens, f"the stream lost tokens over the reload: {len(tokens)}"
    assert proxy.node("a")["served"] >= 1

    # Capacity 1 each: two streams at once run one at a, one at b.
    after = [Exchange.post(proxy.port, CHAT, chat_body(24), timeout=60) for _ in range(2)]
    for stream in after:
        stream.read_all()
        assert stream.status == 200
        assert stream.complete
    assert {stream.response_headers["x-failover-node"] for stream in after} == {"a", "b"}

    gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(tokens)]
    after_hup = sum(1 for token in tokens if running.started + token.at > hup)
    figures = {
        "sighup_to_reloaded_ms": round(logged * 1000),
        "sighup_to_b_discovered_ms": round(discovered * 1000),
        "tokens_read_before_sighup": read_before,
        "tokens_after_sighup": after_hup,
        "tokens": len(tokens),
        "median_token_gap_ms": round(statistics.median(gaps) * 1000),
        "largest_token_gap_ms": round(max(gaps) * 1000),
        "largest_gap_after_token": gaps.index(max(gaps)) + 1,
    }
    report.record("reload adds an engine mid-stream", "llama-server", **figures)
    print("reload:", figures)


def test_an_engine_added_by_a_reload_is_read(fleet: Fleet, log_dir: Path) -> None:
    a, b = fleet.engines("llama-server", "a", "b")  # one slot each: total_slots 1
    config = log_dir / "fleet.toml"
    _fleet_file(config, [("a", a.url)], capacity="")
    proxy = _serve(fleet, config, log_dir)
    wait_for(lambda: proxy.node("a")["capacity"] == 1, 20, what="a's auto capacity")
    _fleet_file(config, [("a", a.url), ("b", b.url)], capacity="")
    _reload(proxy)
    wait_for(lambda: proxy.node("b")["capacity"] == 1, 20, what="b's auto capacity")
