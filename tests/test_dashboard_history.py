"""``GET /history``: the dashboard's sparklines as JSON, under ``MockClock``.

The sampler (``service/sampler.py``) runs beside in-memory traffic to fake
nodes; the route's document is compared whole at exact virtual times.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import attrs
import h11
import trio
import trio.testing

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.service.admin import serve_admin_connection
from trio_failover.service.history import History
from trio_failover.service.sampler import sample_history
from trio_failover.testing import FakeNode, Fleet, frozen, request, slow_head

BODY = json.dumps(
    {"model": "qwen3:32b", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
STALL = 4.5  # response-header timeout: b stalls this long, then cools as long
HEAD = 2.0  # a answers its head after this long


async def admin_get(
    proxy: Proxy, target: str, history: History | None, headers: tuple[tuple[str, str], ...] = ()
) -> tuple[int, bytes]:
    """One GET on an in-memory admin connection; (status, body)."""
    client, server = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(serve_admin_connection, proxy, server, history=history)
        )
        head = [("host", "admin.test"), *headers]
        data = conn.send(h11.Request(method="GET", target=target, headers=head))
        await client.send_all((data or b"") + (conn.send(h11.EndOfMessage()) or b""))
        status, parts = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await client.receive_some(65536)))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
        await client.aclose()
    return status, b"".join(parts)


def fleet_proxy(fleet: Fleet, **settings: Any) -> Proxy:
    # b first in ranking order, and frozen: every workload stalls there first.
    b, a = fleet.upstreams()
    config = Config(
        upstreams=[b, attrs.evolve(a, capacity=2)],
        admin_listen=None,
        response_header_timeout=STALL,
        **settings,
    )
    return Proxy(config, connector=fleet.connector)


async def test_history_after_failovers_and_a_queue(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"b": FakeNode(frozen()), "a": FakeNode(slow_head(HEAD))}) as fleet:
        # Cache affinity off: the same prompt, served by a, would not stall at b again.
        proxy = fleet_proxy(fleet, affinity="off")
        history = History(["b", "a"], interval=10.0, points=5)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_history, proxy, history)
                # 0 s: three workloads stall at b until 4.5 s, then fail over
                # to a, which has two slots: two commit at 6.5 s, the third
                # waits for a slot until 6.5 s and commits at 8.5 s.
                async with trio.open_nursery() as clients:
                    for _ in range(3):
                        clients.start_soon(functools.partial(request, proxy, body=BODY))
                assert trio.current_time() == STALL + 2 * HEAD
                # 12 s: b is ready again (it cooled 4.5 s); one more stall
                # there, then a commits at 18.5 s.
                await trio.sleep_until(12.0)
                response = await request(proxy, body=BODY)
                assert response is not None
                assert response.status == 200
                assert trio.current_time() == 12.0 + STALL + HEAD

                await trio.sleep_until(30.5)
                status, body = await admin_get(proxy, "/history", history)
                nursery.cancel_scope.cancel()
        assert status == 200
        assert json.loads(body) == {
            "interval_s": 10.0,
            "points": 5,
            "closed": 3,  # at 10, 20 and 30 s
            "nodes": [
                {
                    "name": "b",
                    "slots": [None, None, 3, 1, 0],
                    "queue": [None, None, 0, 0, 0],
                    "ttfb_p50_ms": [None] * 5,
                    "ttfb_p95_ms": [None] * 5,
                    "failures": [None, None, 3, 1, 0],
                },
                {
                    "name": "a",
                    # Looks at 5 and 6 s: both slots taken, the third workload
                    # waiting for one; at 7 and 8 s only the third runs.
                    "slots": [None, None, 2, 1, 0],
                    "queue": [None, None, 1, 0, 0],
                    "ttfb_p50_ms": [None, None, 6500.0, 6500.0, None],
                    "ttfb_p95_ms": [None, None, 8500.0, 6500.0, None],
                    "failures": [None, None, 0, 0, 0],
                },
            ],
        }
        # Stopped, the sampler takes the append off the request path.
        assert proxy.metrics.ttfb_samples == {}


async def test_commits_are_kept_only_while_a_sampler_runs(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"b": FakeNode(slow_head(0.25)), "a": FakeNode(slow_head(HEAD))}) as fleet:
        proxy = fleet_proxy(fleet)
        history = History(["b", "a"], interval=10.0)
        await request(proxy, body=BODY)
        assert history.ttfb == {"b": [], "a": []}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_history, proxy, history)
            await trio.sleep(1.0)
            await request(proxy, body=BODY)
            assert history.ttfb == {"b": [0.25], "a": []}
            nursery.cancel_scope.cancel()
        await request(proxy, body=BODY)
        assert history.ttfb == {"b": [0.25], "a": []}


async def test_history_needs_the_admin_token(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"b": FakeNode(frozen()), "a": FakeNode(slow_head(HEAD))}) as fleet:
        proxy = fleet_proxy(fleet, admin_token="adm-1f0e2d3c4b5a6978")
        history = History(["b", "a"])
        status, body = await admin_get(proxy, "/history", history)
        assert status == 401
        assert json.loads(body)["error"]["code"] == "invalid_admin_token"
        status, body = await admin_get(
            proxy,
            "/history",
            history,
            headers=(("authorization", "Bearer adm-1f0e2d3c4b5a6978"),),
        )
        assert status == 200
        assert json.loads(body)["closed"] == 0


async def test_no_history_without_a_sampler(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"b": FakeNode(frozen()), "a": FakeNode(slow_head(HEAD))}) as fleet:
        status, body = await admin_get(fleet_proxy(fleet), "/history", None)
        assert status == 404
        assert json.loads(body)["error"]["code"] == "not_found"


async def test_the_admin_listener_samples_its_history() -> None:
    """``serve_admin`` over real sockets: ``/history`` answers with the default rings."""
    import httpx

    from trio_failover.service.server import serve

    async with Fleet({"b": FakeNode(slow_head(0.0)), "a": FakeNode(slow_head(0.0))}) as fleet:
        config = Config(
            upstreams=[await fleet.serve_tcp("b"), await fleet.serve_tcp("a")],
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            discovery_interval=0,
        )
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(serve, config)
                async with httpx.AsyncClient(base_url=bound.admin_url) as http:
                    answer = await http.get("/history")
                nursery.cancel_scope.cancel()
    assert answer.status_code == 200
    document = answer.json()
    assert (document["interval_s"], document["points"]) == (10.0, 90)
    assert [node["name"] for node in document["nodes"]] == ["b", "a"]
    assert all(len(node["slots"]) == 90 for node in document["nodes"])


async def test_workloads_carry_the_model_they_asked_for(autojump_clock: trio.abc.Clock) -> None:
    """The dashboard's Model column: ``model`` in ``/status`` (and the events), cut short."""
    async with Fleet({"b": FakeNode(slow_head(0.25)), "a": FakeNode(slow_head(HEAD))}) as fleet:
        proxy = fleet_proxy(fleet)
        long_name = "m" * 300
        for body in (BODY, b"", json.dumps({"model": long_name}).encode()):
            response = await request(proxy, body=body)
            assert response is not None
        with proxy.events.subscribe(16) as subscription:
            await request(proxy, body=BODY)
            published = []
            while subscription.receive.statistics().current_buffer_used:
                published.append(subscription.receive.receive_nowait())
        status, body = await admin_get(proxy, "/status", None)
    assert status == 200
    models = [w["model"] for w in json.loads(body)["workloads"]]
    assert models == ["qwen3:32b", None, "m" * 256, "qwen3:32b"]
    assert {event["model"] for event in published} == {"qwen3:32b"}


async def test_every_workload_says_its_age_finished_or_not(autojump_clock: trio.abc.Clock) -> None:
    """``age_ms``: since it started, what the dashboard orders its rows by, newest first."""
    async with Fleet({"b": FakeNode(slow_head(1.0)), "a": FakeNode(slow_head(100.0))}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                slow = [("x-request-id", "slow"), ("x-failover-node", "a")]
                nursery.start_soon(functools.partial(request, proxy, body=BODY, headers=slow))
                await trio.sleep(2.0)
                await request(proxy, body=BODY, headers=[("x-request-id", "quick")])
                await trio.sleep(3.0)
                status, body = await admin_get(proxy, "/status", None)
                nursery.cancel_scope.cancel()
    assert status == 200
    assert trio.current_time() == 6.0
    ages = {
        w["id"]: (w["state"], w["duration_ms"], w["age_ms"]) for w in json.loads(body)["workloads"]
    }
    assert ages == {"quick": ("completed", 1000.0, 4000.0), "slow": ("running", 6000.0, 6000.0)}
