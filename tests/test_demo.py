"""``trio-failover demo``: the scripted scenario, its checks, and the serving afterwards.

The demo runs on real loopback sockets with the real clock (it is for
humans with curl), so these tests take a few seconds each; every wait is
bounded.
"""

from __future__ import annotations

import io
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from trio_failover import Config, Upstream, demo
from trio_failover.demo.view import Watcher
from trio_failover.proxy import Proxy
from trio_failover.testing import healthy

BEHAVIOURS = (
    "failover off the frozen node",
    "cooldown: the next request went straight to healthy",
    "pre-commit drop: failed over, no cooldown",
    "cooldown expired: frozen is ready again",
    "client abort: upstream work cancelled, no failover",
)
ONCE_LIMIT = 20.0  # seconds of real time a --once run may take


def assert_every_behaviour_shown(out: str) -> None:
    for behaviour in BEHAVIOURS:
        assert f"[ok]     {behaviour}" in out, behaviour
    assert "[FAILED]" not in out
    assert "\x1b[" not in out  # no colour codes when stdout is not a terminal


def test_run_demo_once_shows_every_behaviour(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    status = demo.run_demo(True)
    took = time.monotonic() - started
    out = capsys.readouterr().out
    assert status == 0, out
    assert took < ONCE_LIMIT
    assert_every_behaviour_shown(out)
    # The live view: per request, the attempts with their outcomes and the node states.
    assert re.search(r"1\s+frozen\s+header_timeout\s+\d+ ms", out)
    assert re.search(r"1\s+dropping\s+closed_early\s+\d+ ms", out)
    assert re.search(r"1\s+frozen\s+client_abort\s+\d+ ms", out)
    assert re.search(r"frozen\s+cooling\s+\d\.\d s \(header_timeout\)", out)
    assert "frozen is ready again (expired)" in out
    assert out.count("token 'word") == demo.TOKENS
    step_2 = out[out.index("2. The cooldown") : out.index("3. A pre-commit drop")]
    assert step_2.index("commit: healthy") < step_2.index("token 'word0")  # in order
    assert "keeps serving" not in out  # --once exits after the script


def test_a_behaviour_not_seen_fails_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A "dropping" node that answers properly: step 3 has nothing to show.
    monkeypatch.setattr(demo, "drop_before_body", lambda: healthy(b"{}"))
    assert demo.run_demo(True) == 1
    out = capsys.readouterr().out
    assert "[FAILED] pre-commit drop: failed over, no cooldown" in out
    assert "[ok]     failover off the frozen node" in out


def test_demo_once_as_a_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_failover", "demo", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert_every_behaviour_shown(done.stdout)
    assert done.stderr == ""


def wait_for_line(log: Path, process: subprocess.Popen[bytes], pattern: str) -> re.Match[str]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text())
        if match:
            return match
        assert process.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} within 30 s:\n{log.read_text()}")


def test_demo_serves_curl_after_the_script_until_ctrl_c(tmp_path: Path) -> None:
    log = tmp_path / "demo.out"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "trio_failover", "demo"], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        url = wait_for_line(log, process, r"keeps serving on (http://\S+) until Ctrl-C")[1]
        admin = wait_for_line(log, process, r"Dashboard: (http://\S+)/")[1]
        text = log.read_text()
        assert url == "http://127.0.0.1:8080" or "127.0.0.1:8080 is taken" in text
        assert admin == "http://127.0.0.1:8081" or "127.0.0.1:8081 is taken" in text
        assert_every_behaviour_shown(text)

        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-request-id": "from-test"},
            timeout=10,
        )
        assert response.status_code == 200
        assert response.headers["x-failover-node"] == "healthy"
        assert response.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"{admin}/healthz", timeout=5).text == "ok"
        wait_for_line(log, process, r"request from-test\n(.*\n)*.*completed: 200 from healthy")

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
        assert "SIGINT: stopping" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_taken_ports_fall_back_to_any_free_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        assert not demo._port_is_free(taken)
        monkeypatch.setattr(demo, "PREFERRED_LISTEN", taken)
        serving = demo.Demo(demo.Screen(io.StringIO()), once=False)
        listen, admin = serving._listen_addresses()
        assert listen == demo.ANY_PORT
        assert admin == demo.PREFERRED_ADMIN or not demo._port_is_free(demo.PREFERRED_ADMIN)
    once = demo.Demo(demo.Screen(io.StringIO()), once=True)
    assert once._listen_addresses() == (demo.ANY_PORT, demo.ANY_PORT)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert demo.Screen(FakeTerminal()).style("ok", "green") == "\x1b[32mok\x1b[0m"
    assert demo.Screen(io.StringIO()).style("ok", "green") == "ok"
    monkeypatch.setenv("NO_COLOR", "1")
    assert demo.Screen(FakeTerminal()).style("ok", "green") == "ok"


async def test_a_script_line_prints_after_the_events_published_before_it() -> None:
    # The client's callback can run before the watcher task although the
    # commit event was published first: the watcher holds the event, not yet
    # shown, when the token arrives. The token must still come second.
    proxy = Proxy(Config(upstreams=[Upstream("healthy", "http://127.0.0.1:9")]))
    out = io.StringIO()
    watcher = Watcher(demo.Screen(out), proxy)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watcher.run)
            await trio.testing.wait_all_tasks_blocked()
            started = trio.current_time()
            proxy.events.publish(
                {"type": "workload", "id": "w", "state": "committed", "node": "healthy"}
            )
            watcher.note(started, "token 'word0 '")  # no checkpoint in between
            await trio.testing.wait_all_tasks_blocked()
            watcher.note(started, "token 'word1 '")  # no event pending: printed on its own
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    lines = [re.sub(r"^\s*\+\d+\.\d+ s\s+", "", line) for line in out.getvalue().splitlines()]
    assert lines == [
        "commit: healthy's response starts reaching the client",
        "token 'word0 '",
        "token 'word1 '",
    ]
