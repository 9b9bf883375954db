"""The dashboard in a real browser: headless Chromium driven over the DevTools protocol.

A proxy with three real (127.0.0.1) fake nodes serves traffic while Chromium
loads the dashboard from the admin listener; the test reads the rendered DOM
until it shows the stalled node cooling and the served workloads, delivered
by ``/status`` and the ``/events`` WebSocket under the page's own
Content-Security-Policy; another reads the sparklines drawn from
``/history`` and checks them against the document.

The driver is trio-websocket speaking the Chrome DevTools Protocol to
``chromium --remote-debugging-port=0``: no extra dependency.

Needs Debian's ``chromium`` (``apt-get install -y chromium``). Without it
the test is skipped, unless ``TRIO_FAILOVER_REQUIRE_BROWSER=1`` is set (as
in CI): then it fails, so CI cannot pass by skipping it.

``TRIO_FAILOVER_SCREENSHOT=docs/dashboard.png`` also saves a screenshot of
the page as the sparklines test saw it (its history: 30 points of 1 s), and
``TRIO_FAILOVER_CLIENTS_SCREENSHOT=docs/dashboard-clients.png`` one of its
clients panel.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio_websocket

from trio_failover import ClientKey, Config, Upstream
from trio_failover.service.history import SERIES, History
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import (
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    drop_before_body,
    frozen,
    healthy,
    openai,
    slow_head,
    with_health,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRE_BROWSER = os.environ.get("TRIO_FAILOVER_REQUIRE_BROWSER", "") not in ("", "0")
SCREENSHOT = os.environ.get("TRIO_FAILOVER_SCREENSHOT")
CLIENTS_SCREENSHOT = os.environ.get("TRIO_FAILOVER_CLIENTS_SCREENSHOT")
STALL = 5.0  # response-header timeout: the stall, and then the cooldown, last this long
BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()

# What the test reads from the page: its own rendering, via data attributes.
READ_PAGE = """JSON.stringify({
  connection: document.getElementById("connection").textContent,
  queued: document.getElementById("queued").textContent,
  nodes: [...document.querySelectorAll("#nodes tr")].map(tr => ({
    name: tr.dataset.node, state: tr.dataset.state, text: tr.innerText})),
  workloads: [...document.querySelectorAll("#workloads tr")].map(tr => ({
    id: tr.dataset.id, state: tr.dataset.state, text: tr.innerText})),
})"""


# The clients panel: one row per client, its cells' text.
READ_CLIENTS = """JSON.stringify([...document.querySelectorAll("#clients tr")].map(tr => ({
  client: tr.dataset.client,
  cells: [...tr.cells].map(td => td.innerText)})))"""


class DevTools:
    """The smallest Chrome DevTools Protocol client: calls by id, events ignored."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.session: str | None = None

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self.ids)
        message: dict[str, Any] = {"id": number, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        await self.ws.send_message(json.dumps(message))
        while True:
            answer = json.loads(await self.ws.get_message())
            if answer.get("id") == number:
                if "error" in answer:
                    raise AssertionError(f"{method}: {answer['error']}")
                result: dict[str, Any] = answer["result"]
                return result

    async def open_page(self, url: str) -> None:
        target = await self.call("Target.createTarget", url="about:blank")
        attached = await self.call(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        self.session = attached["sessionId"]
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=1280,
            height=800,
            deviceScaleFactor=1,
            mobile=False,
        )
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def read_page(self) -> dict[str, Any]:
        text = await self.evaluate(READ_PAGE)
        page: dict[str, Any] = json.loads(text) if text else {}
        return page


async def wait_for_page(devtools: DevTools, ready: Any, what: str) -> dict[str, Any]:
    """Poll the rendered page until ``ready(page)``; fails with the last page seen."""
    page: dict[str, Any] = {}
    for _ in range(200):
        try:
            page = await devtools.read_page()
        except AssertionError:
            page = {}  # the page is between documents
        if page and ready(page):
            return page
        await trio.sleep(0.1)
    raise AssertionError(f"the dashboard never showed {what}; last seen: {page}")


async def start_chromium(nursery: trio.Nursery, profile: Path) -> str:
    """Start headless Chromium; returns its DevTools WebSocket URL."""
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # CI runs as root, where the sandbox cannot start
        "--disable-gpu",
        "--no-first-run",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "about:blank",
    ]
    # Cancelling run_process terminates Chromium (SIGTERM, then SIGKILL).
    await nursery.start(
        functools.partial(
            trio.run_process,
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    )
    port_file = trio.Path(profile / "DevToolsActivePort")
    for _ in range(300):
        if await port_file.exists():
            lines = (await port_file.read_text()).split()
            if len(lines) == 2:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        await trio.sleep(0.05)
    raise AssertionError("Chromium did not open its DevTools port")


@contextlib.asynccontextmanager
async def open_browser(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[DevTools]:
    """Headless Chromium, run in ``nursery``, and a DevTools client to it."""
    browser_url = await start_chromium(nursery, tmp_path / "profile")
    async with trio_websocket.open_websocket_url(
        browser_url, max_message_size=64 * 1024 * 1024
    ) as ws:
        yield DevTools(ws)


async def wait_live(devtools: DevTools, nodes: int, what: str) -> dict[str, Any]:
    """Wait until the page's event stream is live and it shows ``nodes`` node rows."""
    return await wait_for_page(
        devtools, lambda p: p["connection"] == "live" and len(p["nodes"]) == nodes, what
    )


async def serve_local(
    nursery: trio.Nursery,
    upstreams: list[Upstream],
    history: History | None = None,
    **settings: Any,
) -> BoundAddresses:
    """``serve`` in ``nursery`` with both listeners on free 127.0.0.1 ports."""
    config = Config(
        upstreams=upstreams, listen="127.0.0.1:0", admin_listen="127.0.0.1:0", **settings
    )
    bound: BoundAddresses = await nursery.start(functools.partial(serve, config, history=history))
    return bound


@pytest.fixture
def chromium() -> str:
    if CHROMIUM is None:
        if REQUIRE_BROWSER:
            pytest.fail("TRIO_FAILOVER_REQUIRE_BROWSER=1 but `chromium` is not installed")
        pytest.skip("needs Debian's `chromium` (apt-get install -y chromium)")
    return CHROMIUM


async def send_traffic(client_url: str, count: int, concurrency: int) -> None:
    async with httpx.AsyncClient(base_url=client_url, timeout=30) as http:

        async def one(number: int) -> None:
            response = await http.post(
                "/v1/chat/completions", content=BODY, headers={"x-request-id": f"chat-{number}"}
            )
            assert response.status_code == 200

        for start in range(0, count, concurrency):
            async with trio.open_nursery() as batch:
                for number in range(start, min(start + concurrency, count)):
                    batch.start_soon(one, number)
            await trio.sleep(0.05)


async def test_dashboard_shows_the_cooling_node_and_the_served_workloads(
    chromium: str, tmp_path: Path
) -> None:
    nodes = {
        "gpu-a": FakeNode(frozen()),
        "gpu-b": FakeNode(openai(tokens=8, token_delay=0.02)),
        "gpu-c": FakeNode(healthy(b'{"ok": true}')),
    }
    with trio.fail_after(50):
        async with Fleet(nodes) as fleet, trio.open_nursery() as nursery:
            bound = await serve_local(
                nursery,
                [await fleet.serve_tcp(name) for name in nodes],
                response_header_timeout=STALL,
                discovery_interval=0,  # gpu-b lists another model than BODY's
            )
            async with open_browser(nursery, tmp_path) as devtools:
                await devtools.open_page(f"{bound.admin_url}/")
                page = await wait_live(devtools, 3, "a live event stream and three nodes")
                assert [n["name"] for n in page["nodes"]] == ["gpu-a", "gpu-b", "gpu-c"]
                assert {n["state"] for n in page["nodes"]} == {"ready"}

                # One request stalls on gpu-a for STALL seconds and fails over;
                # gpu-a then cools for STALL seconds while more traffic flows.
                async with (
                    httpx.AsyncClient(base_url=bound.client_url, timeout=30) as http,
                    trio.open_nursery() as stalled,
                ):
                    stalled.start_soon(
                        lambda: http.post(
                            "/v1/chat/completions",
                            content=BODY,
                            headers={"x-request-id": "stalled-1"},
                        )
                    )
                    await wait_for_page(
                        devtools,
                        lambda p: any(
                            w["id"] == "stalled-1" and "gpu-a" in w["text"] for w in p["workloads"]
                        ),
                        "the stalled workload running on gpu-a",
                    )
                traffic_sent = trio.Event()

                async def traffic() -> None:
                    await send_traffic(bound.client_url, 24, 3)
                    traffic_sent.set()

                nursery.start_soon(traffic)

                def cooling_and_served(p: dict[str, Any]) -> bool:
                    states = {n["name"]: n["state"] for n in p["nodes"]}
                    done = [w for w in p["workloads"] if w["state"] == "completed"]
                    return states["gpu-a"] == "cooling" and len(done) >= 6

                page = await wait_for_page(
                    devtools, cooling_and_served, "gpu-a cooling and six served workloads"
                )
                [gpu_a] = [n for n in page["nodes"] if n["name"] == "gpu-a"]
                assert "header_timeout" in gpu_a["text"]
                [stalled_row] = [w for w in page["workloads"] if w["id"] == "stalled-1"]
                assert stalled_row["state"] == "completed"
                for expected in ("gpu-a", "header_timeout", "gpu-b", "200"):
                    assert expected in stalled_row["text"]
                # gpu-a is demoted: no chat request went there. A row can be
                # caught between its "queued" event (no node yet) and the
                # next one, so only completed rows must name their node.
                chats = [w for w in page["workloads"] if w["id"].startswith("chat-")]
                rows = [w["text"] for w in chats]
                assert not any("gpu-a" in text for text in rows), rows
                completed = [w["text"] for w in chats if w["state"] == "completed"]
                assert len(completed) >= 5, rows
                assert all("gpu-b" in text for text in completed), rows
                # Cancelled in the middle of a request, httpx would leave its
                # answer's stream to the garbage collector (a ResourceWarning).
                await traffic_sent.wait()
            nursery.cancel_scope.cancel()


async def test_dashboard_with_the_admin_token_in_its_url(chromium: str, tmp_path: Path) -> None:
    """Opened as ``/?token=...``, the page polls ``/status`` and opens ``/events`` with it."""
    token, key = "adm-9c1e7b2d4f80a635", "ka-52d8e0b1c3f9a746"
    with trio.fail_after(50):
        async with (
            Fleet({"gpu-a": FakeNode(openai(tokens=3))}) as fleet,
            trio.open_nursery() as nursery,
        ):
            bound = await serve_local(
                nursery,
                [await fleet.serve_tcp("gpu-a")],
                clients=(ClientKey("alice", key),),
                admin_token=token,
                discovery_interval=0,  # gpu-a lists another model than BODY's
            )
            async with open_browser(nursery, tmp_path) as devtools:
                await devtools.open_page(f"{bound.admin_url}/?token={token}")
                await wait_live(devtools, 1, "a live event stream and the node, with the token")
                async with httpx.AsyncClient(base_url=bound.client_url, timeout=30) as http:
                    response = await http.post(
                        "/v1/chat/completions",
                        content=BODY,
                        headers={"x-request-id": "keyed-1", "authorization": f"Bearer {key}"},
                    )
                    assert response.status_code == 200
                page = await wait_for_page(
                    devtools,
                    lambda p: any(
                        w["id"] == "keyed-1" and w["state"] == "completed" for w in p["workloads"]
                    ),
                    "the keyed workload completed",
                )
                [row] = [w for w in page["workloads"] if w["id"] == "keyed-1"]
                assert "alice" in row["text"]
                assert key not in json.dumps(page)

                # Without the token not even the page is served.
                await devtools.call("Page.navigate", url=f"{bound.admin_url}/")
                shown = ""
                for _ in range(100):
                    shown = await devtools.evaluate("document.body && document.body.innerText")
                    if shown and "invalid_admin_token" in shown:
                        break
                    await trio.sleep(0.1)
                assert "invalid_admin_token" in (shown or "")
            nursery.cancel_scope.cancel()


async def test_dashboard_shows_down_nodes_model_names_and_last_news(
    chromium: str, tmp_path: Path
) -> None:
    nodes = {"gpu-a": FakeNode(refuse=True), "gpu-b": FakeNode(openai("qwen3:32b"))}
    with trio.fail_after(50):
        async with Fleet(nodes) as fleet, trio.open_nursery() as nursery:
            up = await fleet.serve_tcp("gpu-b")
            closed = trio.socket.socket()  # bound, never listening: connections are refused
            await closed.bind(("127.0.0.1", 0))
            refusing = Upstream("gpu-a", f"http://127.0.0.1:{closed.getsockname()[1]}")
            bound = await serve_local(nursery, [refusing, up], discovery_interval=0.5)
            async with open_browser(nursery, tmp_path) as devtools:
                await devtools.open_page(f"{bound.admin_url}/")

                def checked(p: dict[str, Any]) -> bool:
                    states = {n["name"]: n["state"] for n in p.get("nodes", [])}
                    return states == {"gpu-a": "down", "gpu-b": "ready"} and all(
                        "check_" in n["text"] for n in p["nodes"]
                    )

                page = await wait_for_page(devtools, checked, "gpu-a down, gpu-b checked")
            closed.close()
            nursery.cancel_scope.cancel()
    rows = {n["name"]: n["text"].split("\t") for n in page["nodes"]}
    # Node, URL, State, Cooldown left, Reason, Slots in use, Served, Failed,
    # Models, Last outcome, Last error.
    a, b = rows["gpu-a"], rows["gpu-b"]
    assert (a[2], a[4], a[8], a[9]) == ("down", "health_check", "any", "check_connect_failed")
    assert a[10].startswith("health check cannot connect")
    # The model's name, not a count of them.
    assert (b[2], b[8], b[9]) == ("ready", "qwen3:32b", "check_ok")


async def test_dashboard_shows_slots_in_use_and_the_queue(chromium: str, tmp_path: Path) -> None:
    # One slot at each node, three slow requests: two run, one waits.
    nodes = {"gpu-a": FakeNode(slow_head(30.0)), "gpu-b": FakeNode(slow_head(30.0))}
    with trio.fail_after(50):
        async with Fleet(nodes) as fleet, trio.open_nursery() as nursery:
            upstreams = [attrs.evolve(await fleet.serve_tcp(name), capacity=1) for name in nodes]
            bound = await serve_local(nursery, upstreams)
            async with open_browser(nursery, tmp_path) as devtools:
                await devtools.open_page(f"{bound.admin_url}/")
                await wait_live(devtools, 2, "a live event stream and two nodes")
                async with (
                    httpx.AsyncClient(base_url=bound.client_url, timeout=60) as http,
                    trio.open_nursery() as clients,
                ):
                    for number in range(3):
                        clients.start_soon(
                            functools.partial(
                                http.post,
                                "/v1/chat/completions",
                                content=BODY,
                                headers={"x-request-id": f"burst-{number}"},
                            )
                        )

                    def two_running_one_queued(p: dict[str, Any]) -> bool:
                        # Slots and the queue length come from /status (polled
                        # each second), workload states from the events.
                        states = sorted(w["state"] for w in p["workloads"])
                        full = all("1 / 1" in n["text"] for n in p["nodes"])
                        return (
                            full
                            and p["queued"] == "1"
                            and states
                            == [
                                "queued",
                                "running",
                                "running",
                            ]
                        )

                    page = await wait_for_page(
                        devtools, two_running_one_queued, "two workloads running, one queued"
                    )
                    [waiting] = [w for w in page["workloads"] if w["state"] == "queued"]
                    assert waiting["id"].startswith("burst-")
                    clients.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


async def test_dashboard_lists_workloads_by_start_whatever_their_state(
    chromium: str, tmp_path: Path
) -> None:
    """A workload stuck at a node since before the page opened sits between its elders and juniors.

    Newest first, as the page says: the two that started after it above,
    the two that finished before it started below.
    """
    arrived = trio.Event()

    async def stuck(io: NodeIO, received: ReceivedRequest) -> None:
        arrived.set()
        await io.wait_closed()  # the model works on, its web server answers /health

    nodes = {"gpu-a": FakeNode(healthy()), "gpu-z": FakeNode(with_health(stuck))}
    with trio.fail_after(50):
        async with Fleet(nodes) as fleet, trio.open_nursery() as nursery:
            upstreams = [await fleet.serve_tcp(name) for name in nodes]
            bound = await serve_local(nursery, upstreams, discovery_interval=0)
            async with (
                httpx.AsyncClient(base_url=bound.client_url, timeout=60) as http,
                trio.open_nursery() as waiting,
            ):

                async def send(rid: str, *, node: str = "gpu-a") -> None:
                    headers = {"x-request-id": rid, "x-failover-node": node}
                    await http.post("/v1/chat/completions", content=BODY, headers=headers)

                await send("before-1")
                await send("before-2")
                waiting.start_soon(functools.partial(send, "stuck", node="gpu-z"))
                await arrived.wait()
                await send("after-1")
                await send("after-2")
                async with open_browser(nursery, tmp_path) as devtools:
                    await devtools.open_page(f"{bound.admin_url}/")
                    page = await wait_for_page(
                        devtools,
                        lambda p: len(p["workloads"]) == 5,
                        "the five workloads of /status",
                    )
                waiting.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    rows = [(w["id"], w["state"]) for w in page["workloads"]]
    assert rows == [
        ("after-2", "completed"),
        ("after-1", "completed"),
        ("stuck", "running"),
        ("before-2", "completed"),
        ("before-1", "completed"),
    ]


# Installed before the page's own script. Timers never fire (as if the first
# poll interval and redraw tick had not come yet), and when #nodes and
# #workloads first get rows, it notes how many GET /status answers the page
# had by then.
WATCH_FIRST_RENDER = """
window.setTimeout = () => 0;
window.setInterval = () => 0;
window.__first = {};
const statusCount = () => performance.getEntriesByType("resource")
  .filter(entry => new URL(entry.name).pathname === "/status").length;
new MutationObserver(() => {
  for (const id of ["nodes", "workloads"]) {
    const body = document.getElementById(id);
    if (body && body.children.length && !(id in window.__first)) {
      window.__first[id] = statusCount();
    }
  }
}).observe(document, {childList: true, subtree: true});
"""


async def test_dashboard_renders_on_the_first_status(chromium: str, tmp_path: Path) -> None:
    nodes = {"gpu-a": FakeNode(healthy(b'{"ok": true}')), "gpu-b": FakeNode(healthy())}
    with trio.fail_after(40):
        async with Fleet(nodes) as fleet, trio.open_nursery() as nursery:
            bound = await serve_local(
                nursery,
                [await fleet.serve_tcp(name) for name in nodes],
                discovery_interval=0,  # the nodes list no models
            )
            async with httpx.AsyncClient(base_url=bound.client_url, timeout=30) as http:
                answer = await http.post(
                    "/v1/chat/completions", content=BODY, headers={"x-request-id": "before"}
                )
                assert answer.status_code == 200
            async with open_browser(nursery, tmp_path) as devtools:
                await devtools.open_page("about:blank")
                await devtools.call("Page.enable")
                await devtools.call(
                    "Page.addScriptToEvaluateOnNewDocument", source=WATCH_FIRST_RENDER
                )
                await devtools.call("Page.navigate", url=f"{bound.admin_url}/")
                page = await wait_for_page(
                    devtools,
                    lambda p: len(p["nodes"]) == 2 and len(p["workloads"]) == 1,
                    "the nodes and the workload from /status",
                )
                assert [n["name"] for n in page["nodes"]] == ["gpu-a", "gpu-b"]
                assert page["workloads"][0]["id"] == "before"
                # No event came (no traffic), no timer fired: the first /status
                # drew both tables.
                first = await devtools.evaluate("JSON.stringify(window.__first)")
                assert json.loads(first) == {"nodes": 1, "workloads": 1}
            nursery.cancel_scope.cancel()


# What the test reads of the sparklines: per node row, each line's series,
# its declared number of points and the M/L commands its path really has.
READ_SPARKLINES = """JSON.stringify({
  rows: [...document.querySelectorAll("#history tr")].map(tr => ({
    node: tr.dataset.node, closed: Number(tr.dataset.closed), text: tr.innerText,
    lines: [...tr.querySelectorAll("svg path.line")].map(path => ({
      series: path.dataset.series, points: Number(path.dataset.points),
      commands: (path.getAttribute("d").match(/[ML]/g) || []).length})),
    charts: tr.querySelectorAll("svg.sparkline").length})),
})"""
KEYS = {"alice": "ka-0d4c8e2f6a1b9357", "bob": "kb-7a3e5c9d1f0b2468"}
# A client of one request a minute: its second and third are refused.
CAROL = ("carol", "kc-5e1a9b7d3c2f8064")


def chat(model: str) -> bytes:
    return json.dumps(
        {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()


async def send_waves(client_url: str, waves: list[int]) -> None:
    """Waves of concurrent chats, alternating keys and models, one wave a second."""
    models = ["qwen3:32b", "qwen3:32b", "llama3.1:8b"]
    async with httpx.AsyncClient(base_url=client_url, timeout=30) as http:
        numbers = itertools.count()

        async def one() -> None:
            number = next(numbers)
            client = "alice" if number % 2 else "bob"
            response = await http.post(
                "/v1/chat/completions",
                content=chat(models[number % len(models)]),
                headers={"x-request-id": f"w-{number}", "authorization": f"Bearer {KEYS[client]}"},
            )
            assert response.status_code == 200

        for size in waves:
            async with trio.open_nursery() as wave:
                for _ in range(size):
                    wave.start_soon(one)
                wave.start_soon(trio.sleep, 1.0)


def clients_match(rows: list[dict[str, Any]], usage: dict[str, Any]) -> bool:
    """Whether the panel's rows are ``usage``'s entries added up per client."""
    totals: dict[str, list[int]] = {}
    for entry in usage["clients"]:
        total = totals.setdefault(entry["client"], [0, 0, 0, 0])
        total[0] += entry["requests"]
        total[1] += entry["prompt_tokens"]
        total[2] += entry["completion_tokens"]
        total[3] += entry["estimated"]
    shown = {}
    for row in rows:
        # Client, Models, Requests, Slot-seconds, Prompt, Completion, Waiting, Limits
        cells = [cell.split("\n") for cell in row["cells"]]
        numbers = [int(cells[i][0].replace(",", "")) for i in (2, 4, 5)]
        estimated = [c for c in cells[5] if c.endswith(" estimated")]
        numbers.append(int(estimated[0].split()[0].replace(",", "")) if estimated else 0)
        shown[row["client"]] = numbers
    return shown == totals


async def test_dashboard_draws_the_last_minutes_per_node(chromium: str, tmp_path: Path) -> None:
    # gpu-a: two slots, streams; gpu-b: drops every answer before its body
    # (a failure, a failover, no cooldown); gpu-c: one slot, the rest waits.
    nodes = {
        "gpu-a": FakeNode(openai("qwen3:32b", tokens=8, token_delay=0.05)),
        "gpu-b": FakeNode(drop_before_body()),
        "gpu-c": FakeNode(openai("qwen3:32b", tokens=6, token_delay=0.05)),
    }
    models = {
        "gpu-a": {"qwen3:32b": "qwen3:32b", "llama3.1:8b": "llama3.1:8b"},
        "gpu-b": None,
        "gpu-c": {"qwen3:32b": "qwen3:32b"},
    }
    capacity = {"gpu-a": 2, "gpu-b": 0, "gpu-c": 1}
    history = History(nodes, interval=1.0, points=30)
    with trio.fail_after(60):
        async with Fleet(nodes) as fleet, trio.open_nursery() as nursery:
            upstreams = [
                attrs.evolve(
                    await fleet.serve_tcp(name), models=models[name], capacity=capacity[name]
                )
                for name in nodes
            ]
            bound = await serve_local(
                nursery,
                upstreams,
                history,
                discovery_interval=0,
                clients=(
                    *(ClientKey(name, key) for name, key in KEYS.items()),
                    ClientKey(*CAROL, rpm=1),
                ),
            )
            async with (
                open_browser(nursery, tmp_path) as devtools,
                httpx.AsyncClient(base_url=bound.admin_url, timeout=10) as admin,
            ):
                await devtools.open_page(f"{bound.admin_url}/")
                await wait_live(devtools, 3, "a live event stream and three nodes")
                await send_waves(bound.client_url, [2, 5, 3, 6, 1, 4])
                async with httpx.AsyncClient(base_url=bound.client_url, timeout=30) as http:
                    carol = [
                        (
                            await http.post(
                                "/v1/chat/completions",
                                content=chat("qwen3:32b"),
                                headers={"authorization": f"Bearer {CAROL[1]}"},
                            )
                        ).status_code
                        for _ in range(3)
                    ]
                assert carol == [200, 429, 429]
                await trio.sleep(1.5)  # the last wave's interval closes

                # The page draws what /history says: the same interval count,
                # then per node and series as many points as the document has
                # values (null: none).
                for _ in range(100):
                    document = (await admin.get("/history")).json()
                    drawn = json.loads(await devtools.evaluate(READ_SPARKLINES))["rows"]
                    if drawn and all(row["closed"] == document["closed"] for row in drawn):
                        break
                    await trio.sleep(0.1)
                else:
                    raise AssertionError(f"the sparklines never caught up: {drawn}")
                page = await devtools.read_page()
                # The clients panel adds up GET /usage per client (polled
                # every 2 s): the same requests and tokens, total above the
                # last hour's.
                for _ in range(100):
                    usage = (await admin.get("/usage")).json()
                    clients = json.loads(await devtools.evaluate(READ_CLIENTS))
                    limits_shown = any(
                        row["client"] == "carol" and row["cells"][7] == "2" for row in clients
                    )
                    if clients and clients_match(clients, usage) and limits_shown:
                        break
                    await trio.sleep(0.1)
                else:
                    raise AssertionError(f"the clients panel never showed {usage}: {clients}")
                if CLIENTS_SCREENSHOT:
                    # The panel scrolled to the top of the viewport, with a margin.
                    clip = json.loads(
                        await devtools.evaluate(
                            "(s => { s.scrollIntoView(); const r = s.getBoundingClientRect();"
                            " return JSON.stringify({x: r.x - 8, y: r.y + scrollY - 8,"
                            " width: r.width + 16, height: r.height + 16}); })"
                            "(document.getElementById('clients').closest('section'))"
                        )
                    )
                    await trio.sleep(0.3)
                    shot = await devtools.call(
                        "Page.captureScreenshot", format="png", clip={**clip, "scale": 1}
                    )
                    await trio.Path(CLIENTS_SCREENSHOT).write_bytes(base64.b64decode(shot["data"]))
                if SCREENSHOT:
                    await devtools.call(
                        "Emulation.setDeviceMetricsOverride",
                        width=1280,
                        height=1020,
                        deviceScaleFactor=1,
                        mobile=False,
                    )
                    await trio.sleep(0.3)
                    shot = await devtools.call("Page.captureScreenshot", format="png")
                    await trio.Path(SCREENSHOT).write_bytes(base64.b64decode(shot["data"]))
            nursery.cancel_scope.cancel()

    assert [row["node"] for row in drawn] == ["gpu-a", "gpu-b", "gpu-c"]
    expected = {entry["name"]: entry for entry in document["nodes"]}
    for row in drawn:
        entry = expected[row["node"]]
        assert row["charts"] == 4  # slots, queue, time to first byte, failures
        assert sorted(line["series"] for line in row["lines"]) == sorted(SERIES)
        for line in row["lines"]:
            values = entry[line["series"]]
            assert len(values) == 30
            count = sum(value is not None for value in values)
            assert (line["points"], line["commands"]) == (count, count), (row["node"], line)
        # Every closed interval has a point of slots, queue and failures.
        slots = next(line for line in row["lines"] if line["series"] == "slots")
        assert slots["points"] == min(document["closed"], 30) >= 6
    ttfb = {row["node"]: row["lines"] for row in drawn}
    commits = {
        name: next(line["points"] for line in lines if line["series"] == "ttfb_p50_ms")
        for name, lines in ttfb.items()
    }
    assert commits["gpu-b"] == 0  # it never committed anything
    assert commits["gpu-a"] >= 3
    assert commits["gpu-c"] >= 1
    assert sum(v or 0 for v in expected["gpu-b"]["failures"]) >= 3
    assert max(v or 0 for v in expected["gpu-a"]["slots"]) == 2
    assert max(v or 0 for v in expected["gpu-c"]["queue"]) >= 1

    # Model names, not a count; each workload's client and model.
    rows = {n["name"]: n["text"].split("\t") for n in page["nodes"]}
    assert "qwen3:32b" in rows["gpu-a"][8]
    assert "llama3.1:8b" in rows["gpu-a"][8]
    assert (rows["gpu-b"][8], rows["gpu-c"][8]) == ("any", "qwen3:32b")
    done = [w["text"].split("\t") for w in page["workloads"] if w["state"] == "completed"]
    assert len(done) >= 10
    # Id, Request, Client, Model, Nodes tried, ...
    assert {cells[2] for cells in done} == {"alice", "bob", "carol"}
    assert {cells[3] for cells in done} == {"qwen3:32b", "llama3.1:8b"}
    # The clients panel: both keys, their models, their streams' tokens
    # estimated (the fake streams tell none).
    assert {row["client"] for row in clients} == {"alice", "bob", "carol"}
    for row in clients:
        assert "qwen3:32b" in row["cells"][1]
        assert "estimated" in row["cells"][5]
    # Carol's refused requests are limits hit (from /status), not requests.
    limits = {row["client"]: row["cells"][7] for row in clients}
    assert limits == {"alice": "\u2014", "bob": "\u2014", "carol": "2"}
