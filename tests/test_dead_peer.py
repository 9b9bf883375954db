"""Dead-peer detection end to end: a silent node is dropped, a slow one is not.

The first test needs root and network namespaces; it runs
``tests/netns_scenario.py`` under ``unshare -n`` (see that file). Where that
is impossible it is skipped with the reason, unless
``TRIO_FAILOVER_REQUIRE_NETNS=1`` is set (as ``.ci/run`` does): then it fails,
so that CI cannot pass by skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import h11
import httpx
import pytest
import trio

from trio_failover.core.config import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, serve

SCENARIO = Path(__file__).with_name("netns_scenario.py")
REQUIRE_NETNS = os.environ.get("TRIO_FAILOVER_REQUIRE_NETNS", "") not in ("", "0")


def _netns_unavailable() -> str | None:
    """Why a private network namespace cannot be had here, or None if it can."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (this is {sys.platform})"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux / iproute2)"
    try:
        probe = subprocess.run(
            ["unshare", "-n", "ip", "link", "set", "lo", "up"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        return "`unshare -n` did not finish within 10 s"
    if probe.returncode != 0:
        why = probe.stderr.strip() or f"exit status {probe.returncode}"
        return f"`unshare -n` is not permitted here (needs root): {why}"
    return None


@pytest.mark.netns
def test_silent_node_is_left_for_the_next_within_the_dead_peer_timeout() -> None:
    why = _netns_unavailable()
    if why is not None:
        if REQUIRE_NETNS:
            pytest.fail(f"TRIO_FAILOVER_REQUIRE_NETNS is set but {why}")
        pytest.skip(why)
    run = subprocess.run(
        [
            "unshare",
            "-n",
            sys.executable,
            str(SCENARIO),
            "--dead-peer-timeout",
            "3",
            "--response-header-timeout",
            "120",
            "--limit",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["status"] == 200, result
    assert result["node"] == "second", result
    assert result["body"] == "second", result
    assert result["attempts"] == "2", result
    assert result["requests"] == {"first": 1, "second": 1}, result
    # Well before the 120 s head deadline; and not before the keepalive budget
    # (3 s), so it was the probes that told, not a reset or a closed socket.
    assert 2.5 <= result["elapsed"] < 8.0, result
    # A dead peer before commit demotes the node.
    assert result["first_state"] == "cooling", result
    assert result["first_reason"] == "dead_peer", result


# --- slow but alive ------------------------------------------------------------------------

SLOW_HEAD_DELAY = 6.0
# Offset of tcpi_segs_in in Linux's struct tcp_info (since Linux 4.2): the
# count of segments this socket received, keepalive probes included.
TCPI_SEGS_IN_OFFSET = 140


def _segments_received(sock: trio.socket.SocketType) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int(struct.unpack_from("I", info, TCPI_SEGS_IN_OFFSET)[0])


class SlowNode:
    """Reads a request, stays silent for ``delay`` seconds, then answers."""

    def __init__(self, name: str, delay: float) -> None:
        self.name = name
        self.delay = delay
        self.requests = 0
        # Segments received while the node was silent (keepalive probes).
        self.probes_seen: list[int] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            self.requests += 1
            before = _segments_received(stream.socket)
            await trio.sleep(self.delay)
            self.probes_seen.append(_segments_received(stream.socket) - before)
            body = self.name.encode()
            data = conn.send(
                h11.Response(status_code=200, headers=[("content-length", str(len(body)))])
            )
            await stream.send_all(
                data + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            )
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        try:
            await trio.serve_listeners(self.handle, listeners)
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)


@pytest.mark.skipif(sys.platform != "linux", reason="counts segments through Linux's TCP_INFO")
async def test_slow_but_alive_node_is_not_taken_for_dead() -> None:
    slow = SlowNode("slow", SLOW_HEAD_DELAY)
    spare = SlowNode("spare", 0.0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            slow_port: int = await nursery.start(slow.run)
            spare_port: int = await nursery.start(spare.run)
            config = Config(
                upstreams=(
                    Upstream("slow", f"http://127.0.0.1:{slow_port}"),
                    Upstream("spare", f"http://127.0.0.1:{spare_port}"),
                ),
                listen="127.0.0.1:0",
                admin_listen=None,
                discovery_interval=0,  # the nodes count their requests: no checks
                dead_peer_timeout=2.0,
                response_header_timeout=30.0,
            )
            proxy = Proxy(config)
            shutdown = trio.Event()
            stopped = trio.Event()

            async def run_proxy(task_status: trio.TaskStatus[BoundAddresses]) -> None:
                await serve(config, proxy=proxy, shutdown=shutdown, task_status=task_status)
                stopped.set()

            addresses: BoundAddresses = await nursery.start(run_proxy)
            host, port = addresses.client
            started = trio.current_time()
            async with httpx.AsyncClient(trust_env=False, timeout=25.0) as client:
                response = await client.post(
                    f"http://{host}:{port}/v1/chat/completions", json={"model": "m"}
                )
            elapsed = trio.current_time() - started
            nodes = {node["name"]: node for node in proxy.status()["nodes"]}
            # A graceful stop closes the proxy's listeners; then the nodes go.
            shutdown.set()
            await stopped.wait()
            nursery.cancel_scope.cancel()

    assert response.status_code == 200
    assert response.text == "slow"
    assert response.headers["x-failover-node"] == "slow"
    assert response.headers["x-failover-attempts"] == "1"  # no failover
    assert spare.requests == 0
    assert elapsed >= SLOW_HEAD_DELAY
    assert nodes["slow"]["state"] == "ready"  # no cooldown
    assert nodes["slow"]["failed"] == 0
    # The proxy did probe the silent node (idle 1 s, then every 1 s), and the
    # node's kernel answered each probe, which kept the connection alive.
    assert slow.probes_seen
    assert slow.probes_seen[0] >= 3
