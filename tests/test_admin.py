"""The admin API: /status after a stall, /metrics against the traffic sent, routing.

In-memory tests drive ``admin.serve_admin_connection`` with an h11 client
under ``MockClock(autojump_threshold=0)``, so remaining cooldown times are
exact; one test runs the real listeners of ``serve()`` on 127.0.0.1.
"""

from __future__ import annotations

import json
from typing import Any

import h11
import httpx
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.service.admin import serve_admin_connection
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import FakeNode, Fleet, frozen, healthy, request, slow_head

# Streamed: the response-header timeout bounds the wait for its head (an
# unstreamed request would wait --unstreamed-timeout).
BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def make_proxy(fleet: Fleet, **settings: object) -> Proxy:
    # These tests time the deadlines themselves: no liveness questions between
    # them (--liveness-interval 0; tests/test_frozen_node.py has the questions).
    settings.setdefault("liveness_interval", 0)
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


async def admin_get(
    proxy: Proxy, *targets: str, method: str = "GET", headers: list[tuple[str, str]] | None = None
) -> list[tuple[int, dict[str, str], bytes]]:
    """Send requests on one in-memory keep-alive admin connection."""
    client, server = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    answers = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_admin_connection, proxy, server)
        for target in targets:
            head = [("host", "admin.test"), *(headers or [])]
            data = conn.send(h11.Request(method=method, target=target, headers=head))
            await client.send_all((data or b"") + (conn.send(h11.EndOfMessage()) or b""))
            status, response_headers, parts = 0, {}, []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await client.receive_some(65536)))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    response_headers = {k.decode(): v.decode() for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    parts.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    raise AssertionError(f"unexpected {event!r}")
            answers.append((status, response_headers, b"".join(parts)))
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
        await client.aclose()
    return answers


async def get_status(proxy: Proxy) -> dict[str, Any]:
    [(status, headers, body)] = await admin_get(proxy, "/status")
    assert status == 200
    assert headers["content-type"] == "application/json"
    document: dict[str, Any] = json.loads(body)
    return document


def by_name(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {node["name"]: node for node in status["nodes"]}


async def test_status_shows_the_stalled_node_cooling_with_the_time_left(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        response = await request(proxy, body=BODY)
        assert response is not None
        assert response.status == 200
        assert trio.current_time() == 10.0

        await trio.sleep(3.0)
        status = await get_status(proxy)
        nodes = by_name(status)
        assert nodes["a"] == {
            "name": "a",
            "url": "http://a.invalid:80",
            "state": "cooling",
            "cooldown_remaining_s": 7.0,
            "reason": "header_timeout",
            "models_cooling": {},  # a node serving one model cools whole
            "in_flight": 0,
            "capacity": 0,
            "served": 0,
            "failed": 1,
            "affinity": {"hits": 0, "misses": 0, "matched_bytes": 0},
            "models": None,  # no models configured, no inventory: discovery is not running
            "last_outcome": "header_timeout",
            "last_error": "a: head: no complete response head in 10.0s",
            "last_check": None,  # a streamed request's head: no liveness check
            # an auto engine not detected yet (no check ran), nothing read
            "engine": None,
            "capacity_source": "auto (the engine gives none)",
            "engine_signals": None,
            "engine_error": None,
        }
        assert nodes["b"]["state"] == "ready"
        assert (nodes["b"]["last_outcome"], nodes["b"]["last_error"]) == ("completed", None)
        assert nodes["b"]["cooldown_remaining_s"] == 0
        assert (nodes["b"]["served"], nodes["b"]["failed"]) == (1, 0)
        assert [n["name"] for n in status["nodes"]] == ["a", "b"]  # ranking order
        assert status["version"]
        [workload] = status["workloads"]
        assert [a["node"] for a in workload["attempts"]] == ["a", "b"]

        await trio.sleep(7.0)  # exactly one header timeout after the stall
        assert by_name(await get_status(proxy))["a"]["state"] == "ready"


async def test_status_counts_a_workload_in_flight(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"slow": FakeNode(slow_head(30.0))}) as fleet:
        proxy = make_proxy(fleet)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: request(proxy, body=BODY))
            await trio.sleep(5.0)
            assert by_name(await get_status(proxy))["slow"]["in_flight"] == 1
            [(_, _, body)] = await admin_get(proxy, "/metrics")
            assert value(samples(body.decode()), "trio_failover_in_flight", node="slow") == 1
        assert by_name(await get_status(proxy))["slow"]["in_flight"] == 0
        [(_, _, body)] = await admin_get(proxy, "/metrics")
        assert value(samples(body.decode()), "trio_failover_in_flight", node="slow") == 0


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


async def test_metrics_parse_and_count_the_traffic_sent(autojump_clock: trio.abc.Clock) -> None:
    nodes = {"a": FakeNode(frozen()), "b": FakeNode(healthy(b"ok")), "c": FakeNode(slow_head(50))}
    async with Fleet(nodes) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        for _ in range(3):  # the first stalls on a, fails over, cools a down
            response = await request(proxy, body=BODY)
            assert response is not None
            assert response.status == 200
        # A client that gives up on c (picked by hand) after one second.
        left = await request(proxy, body=BODY, headers=[("x-failover-node", "c")], leave_after=1)
        assert left is None

        [(status, headers, body)] = await admin_get(proxy, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    found = samples(body.decode())

    assert value(found, "trio_failover_attempts_total", node="a", outcome="header_timeout") == 1
    assert value(found, "trio_failover_attempts_total", node="b", outcome="completed") == 3
    assert value(found, "trio_failover_attempts_total", node="c", outcome="client_abort") == 1
    assert value(found, "trio_failover_failovers_total", node="a", outcome="header_timeout") == 1
    assert value(found, "trio_failover_cooldowns_total", node="a", reason="header_timeout") == 1
    assert value(found, "trio_failover_cooling_nodes") == 1
    assert value(found, "trio_failover_client_aborts_total") == 1
    assert value(found, "trio_failover_commits_total", node="b") == 3
    assert value(found, "trio_failover_commits_total", node="c") == 0
    assert value(found, "trio_failover_workloads_total", state="completed", client="anonymous") == 3
    assert value(found, "trio_failover_workloads_total", state="cancelled", client="anonymous") == 1
    for node in ("a", "b", "c"):
        assert value(found, "trio_failover_in_flight", node=node) == 0
    assert value(found, "trio_failover_time_to_head_seconds_count", node="b") == 3
    assert value(found, "trio_failover_time_to_commit_seconds_count", node="b") == 3
    # The failed-over workload waited one whole header timeout before commit.
    assert value(found, "trio_failover_time_to_commit_seconds_sum", node="b") == 10.0
    assert value(found, "trio_failover_time_to_commit_seconds_bucket", node="b", le="5.0") == 2
    assert value(found, "trio_failover_workload_duration_seconds_count", node="b") == 3
    assert value(found, "trio_failover_workload_duration_seconds_count", node="c") == 1
    assert value(found, "trio_failover_workload_duration_seconds_sum", node="c") == 1.0


async def test_routes_methods_and_keep_alive(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet)
        health, missing, events, page = await admin_get(
            proxy, "/healthz", "/nope", "/events", "/?refresh=1"
        )
        assert health[0] == 200
        assert health[2] == b"ok"
        assert missing[0] == 404
        assert json.loads(missing[2])["error"]["code"] == "not_found"
        assert events[0] == 426  # /events is a WebSocket only
        assert events[1]["upgrade"] == "websocket"
        assert page[0] == 200
        assert page[1]["content-type"] == "text/html; charset=utf-8"
        assert b"<title>trio-failover</title>" in page[2]
        policy = page[1]["content-security-policy"]
        assert "script-src 'sha256-" in policy
        assert "connect-src 'self'" in policy

        [head] = await admin_get(proxy, "/status", method="HEAD")
        assert (head[0], head[2]) == (200, b"")
        [post] = await admin_get(proxy, "/status", method="DELETE")
        assert post[0] == 405
        assert post[1]["allow"] == "GET, HEAD"


async def test_cross_origin_websocket_is_refused(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet)
        upgrade = [
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-version", "13"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("origin", "http://evil.example"),
        ]
        [(status, _, body)] = await admin_get(proxy, "/events", headers=upgrade)
        assert status == 403
        assert json.loads(body)["error"]["code"] == "forbidden_origin"
        assert proxy.events.subscriber_count == 0


async def test_malformed_request_gets_400_and_the_listener_survives(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet)
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_admin_connection, proxy, server)
            await client.send_all(b"GET / HTTP/1.1\r\nbad header\r\n\r\n")
            answer = b""
            while chunk := await client.receive_some(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 ")
        [(status, _, _)] = await admin_get(proxy, "/healthz")
        assert status == 200


async def test_real_listeners_keep_the_admin_api_off_the_client_port() -> None:
    with trio.fail_after(10):
        async with Fleet({"a": FakeNode(healthy(b"from the node"))}) as fleet:
            upstream = await fleet.serve_tcp("a")
            config = Config(
                upstreams=[upstream],
                listen="127.0.0.1:0",
                admin_listen="127.0.0.1:0",
                discovery_interval=0,  # the node's last request must be the client's
            )
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(serve, config)
                assert bound.admin is not None
                assert bound.admin != bound.client
                async with httpx.AsyncClient() as http:
                    admin = await http.get(f"{bound.admin_url}/healthz")
                    assert (admin.status_code, admin.text) == (200, "ok")
                    status = await http.get(f"{bound.admin_url}/status")
                    assert status.json()["nodes"][0]["name"] == "a"
                    # The client listener proxies /status like any other path.
                    proxied = await http.get(f"{bound.client_url}/status")
                    assert proxied.text == "from the node"
                    assert fleet["a"].received[-1].target == b"/status"
                nursery.cancel_scope.cancel()


async def test_admin_listener_off() -> None:
    with trio.fail_after(10):
        async with Fleet({"a": FakeNode(healthy())}) as fleet:
            upstream = await fleet.serve_tcp("a")
            config = Config(upstreams=[upstream], listen="127.0.0.1:0", admin_listen=None)
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(serve, config)
                assert bound.admin is None
                nursery.cancel_scope.cancel()
