"""The programs in examples/ run, as a user would run them: in their own process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio

from trio_failover.testing import FakeNode, Fleet, openai

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EMBED = EXAMPLES / "embed.py"


def test_embed_runs_with_its_simulated_nodes() -> None:
    done = subprocess.run([sys.executable, str(EMBED)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "[app] proxy on http://127.0.0.1:" in out
    # The frozen node costs one stall, cools down, and is skipped afterwards.
    assert "[app] node stuck is now cooling (header_timeout)" in out
    assert "[app] request app-1 failed over to gpu-b" in out
    assert "[app] request app-1 completed (stuck:header_timeout -> gpu-b:completed)" in out
    assert "[app] request app-2 completed (gpu-b:completed)" in out
    assert "[app] request app-3 completed (gpu-b:completed)" in out
    assert out.count("[app] answer") == 3
    assert "[app] stuck: cooling, served 0" in out
    assert out.rstrip().endswith("[app] stopped")
    assert done.stderr == ""  # the app keeps the proxy's warnings to itself


async def test_embed_proxies_to_the_nodes_named_on_its_command_line() -> None:
    # Real nodes in this process, the example in another: real clock, bounded.
    nodes = {"one": FakeNode(openai("demo-model")), "two": FakeNode(openai("demo-model"))}
    async with Fleet(nodes) as fleet:
        upstreams = [await fleet.serve_tcp(name) for name in nodes]
        argv = [sys.executable, str(EMBED), *(f"{up.name}={up.url}" for up in upstreams)]
        with trio.fail_after(60):
            done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True)
    out = done.stdout.decode()
    assert "[app] request app-1 completed (one:completed)" in out
    assert "[app] one: ready, served 3" in out
    assert "[app] two: ready, served 0" in out
    assert len(fleet["one"].received) == 3
    assert fleet["one"].received[0].header("x-request-id") == b"app-1"
