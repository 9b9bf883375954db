"""Events: the bus, and /events as a WebSocket (order, node events, slow subscribers).

The WebSocket tests run ``admin.serve_admin_connection`` on in-memory
streams with trio-websocket's own client, under ``MockClock``; the last one
goes through the real listeners of ``serve()`` on 127.0.0.1.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import trio
import trio.testing
import trio_websocket

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.service.admin import (
    ADMIN_HEAD_TIMEOUT,
    CLOSE_FELL_BEHIND,
    CLOSE_GRACE,
    serve_admin_connection,
)
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.telemetry.events import EventBus
from trio_failover.testing import FakeNode, Fleet, frozen, healthy, request

# Streamed: the response-header timeout bounds the wait for its head (an
# unstreamed request would wait --unstreamed-timeout).
BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
TERMINAL = {"completed", "failed", "cancelled"}


def make_proxy(fleet: Fleet, **settings: object) -> Proxy:
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


# -- the bus ------------------------------------------------------------------


async def test_bus_delivers_in_order_and_forgets_closed_subscriptions() -> None:
    bus = EventBus()
    bus.publish({"n": 0})  # nobody listens: nothing happens
    with bus.subscribe(4) as first, bus.subscribe(4) as second:
        assert bus.subscriber_count == 2
        for n in range(3):
            bus.publish({"n": n})
        assert [first.receive.receive_nowait()["n"] for _ in range(3)] == [0, 1, 2]
        assert [second.receive.receive_nowait()["n"] for _ in range(3)] == [0, 1, 2]
    assert bus.subscriber_count == 0
    assert (first.dropped, first.fell_behind) == ("closed", False)


async def test_bus_drops_a_subscriber_that_falls_behind_without_blocking() -> None:
    bus = EventBus()
    with bus.subscribe(2) as slow, bus.subscribe(0) as unbounded:
        for n in range(5):
            bus.publish({"n": n})  # never blocks, never raises
        assert slow.dropped == "fell behind by more than 2 events"
        assert slow.fell_behind
        with trio.move_on_after(1):
            await slow.wait_ended()  # already ended: returns at once
        assert bus.subscriber_count == 1
        assert unbounded.dropped is None
        assert len([event async for event in _take(unbounded, 5)]) == 5
    assert slow.dropped == "fell behind by more than 2 events"  # the reason sticks


async def _take(subscription: Any, count: int) -> Any:
    for _ in range(count):
        yield await subscription.__anext__()


# -- /events over a WebSocket ---------------------------------------------------


async def open_events(
    nursery: trio.Nursery,
    proxy: Proxy,
    *,
    event_buffer: int = 1024,
    queue: int = 1024,
    lockstep: bool = False,
) -> trio_websocket.WebSocketConnection:
    """A trio-websocket client on an in-memory admin connection.

    ``lockstep``: a connection without buffer, where the server's sends wait
    for the client to read (like a full TCP window).
    """
    pair = trio.testing.lockstep_stream_pair if lockstep else trio.testing.memory_stream_pair
    client, server = pair()
    nursery.start_soon(
        functools.partial(serve_admin_connection, proxy, server, event_buffer=event_buffer)
    )
    return await trio_websocket.wrap_client_stream(
        nursery,
        client,  # type: ignore[arg-type]
        "admin.test",
        "/events",
        message_queue_size=queue,
    )


async def test_websocket_sees_each_attempt_then_the_outcome_under_one_id(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        async with trio.open_nursery() as nursery:
            ws = await open_events(nursery, proxy)
            assert proxy.events.subscriber_count == 1
            await trio.sleep(ADMIN_HEAD_TIMEOUT * 2)  # an idle subscriber stays subscribed
            response = await request(proxy, body=BODY, headers=[("x-request-id", "job-1")])
            assert response is not None
            assert response.status == 200

            events = []
            while not (events and events[-1].get("state") in TERMINAL):
                events.append(json.loads(await ws.get_message()))
            await ws.aclose()
            nursery.cancel_scope.cancel()

    workload = [e for e in events if e["type"] == "workload"]
    assert {e["id"] for e in workload} == {"job-1"}
    assert [(e["state"], e["node"]) for e in workload] == [
        ("queued", None),
        ("running", "frozen"),
        ("running", "good"),
        ("committed", "good"),
        ("completed", "good"),
    ]
    assert [e["attempt"] for e in workload[1:3]] == [1, 2]
    final = workload[-1]
    assert [(a["node"], a["outcome"]) for a in final["attempts"]] == [
        ("frozen", "header_timeout"),
        ("good", "completed"),
    ]
    assert final["status"] == 200
    assert final["ttfb_ms"] == 10000.0
    assert final["duration_ms"] == 10000.0

    [cooling] = [e for e in events if e["type"] == "node"]
    assert cooling == {
        "type": "node",
        "node": "frozen",
        "state": "cooling",
        "reason": "header_timeout",
        "until_s": 10.0,
    }
    # The node event comes as the stall is judged: after the frozen attempt,
    # before the failover to the good node.
    assert events.index(cooling) == events.index(workload[1]) + 1


async def test_websocket_sees_the_cooldown_end(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        async with trio.open_nursery() as nursery:
            ws = await open_events(nursery, proxy)
            await request(proxy, body=BODY)
            await trio.sleep(10.0)
            proxy.expire_cooldowns()  # what the admin ticker does every second
            node_events = []
            while len(node_events) < 2:
                event = json.loads(await ws.get_message())
                if event["type"] == "node":
                    node_events.append((event["node"], event["state"], event["reason"]))
            nursery.cancel_scope.cancel()
    assert node_events == [("frozen", "cooling", "header_timeout"), ("frozen", "ready", "expired")]


async def test_the_ticker_reports_an_expiry_without_traffic(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy())}) as fleet:
        proxy = make_proxy(fleet, response_header_timeout=10.0)
        with proxy.events.subscribe(0) as subscription:
            async with trio.open_nursery() as nursery:
                # At 10 s: frozen cools until 20 s; the proxy's own ticker
                # (it runs from the first request on) says when it ends.
                await request(proxy, body=BODY)
                async for event in subscription:
                    if event["type"] == "node" and event["state"] == "ready":
                        break
                assert trio.current_time() == 20.0
                assert event == {
                    "type": "node",
                    "node": "frozen",
                    "state": "ready",
                    "reason": "expired",
                    "until_s": 0,
                }
                nursery.cancel_scope.cancel()


async def read_until_closed(
    ws: trio_websocket.WebSocketConnection,
) -> tuple[int, trio_websocket.CloseReason]:
    """Read every message left; returns how many, and why the connection closed."""
    received = 0
    while True:
        try:
            await ws.get_message()
        except trio_websocket.ConnectionClosed as closed:
            reason = closed.reason
            break
        received += 1
    assert reason is not None
    return received, reason


async def test_subscriber_that_stops_reading_delays_nothing_and_is_dropped(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"good": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet)
        async with trio.open_nursery() as nursery:
            # A client queue of one message: once it holds one and its reader
            # holds the next, nothing more is read from the connection, and
            # the server's sends block.
            ws = await open_events(nursery, proxy, event_buffer=8, queue=1, lockstep=True)
            for _ in range(20):  # 4 events each, far beyond the 8 buffered
                response = await request(proxy, body=BODY)
                assert response is not None
                assert response.status == 200
                assert response.at == 0.0  # no virtual time passes: nothing waited
            assert proxy.events.subscriber_count == 0  # dropped by the bus

            # The client reads again (within CLOSE_GRACE) and gets its close frame.
            received, reason = await read_until_closed(ws)
            assert received < 20 * 4
            assert reason.code == CLOSE_FELL_BEHIND
            assert reason.reason == "fell behind by more than 8 events"
            nursery.cancel_scope.cancel()


async def test_subscriber_that_never_reads_again_is_cut_after_the_grace(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"good": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet)
        client, server = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def admin() -> None:
                await serve_admin_connection(proxy, server, event_buffer=2)
                done.set()

            nursery.start_soon(admin)
            await trio_websocket.wrap_client_stream(
                nursery,
                client,  # type: ignore[arg-type]
                "admin.test",
                "/events",
                message_queue_size=1,
            )
            for _ in range(3):
                await request(proxy, body=BODY)
            dropped_at = trio.current_time()
            assert proxy.events.subscriber_count == 0
            with trio.fail_after(CLOSE_GRACE + 1):
                await done.wait()
            assert trio.current_time() == dropped_at + CLOSE_GRACE
            nursery.cancel_scope.cancel()


async def test_events_over_the_real_admin_listener() -> None:
    with trio.fail_after(20):
        nodes = {"frozen": FakeNode(frozen()), "good": FakeNode(healthy(b"ok"))}
        async with Fleet(nodes) as fleet:
            upstreams = [await fleet.serve_tcp("frozen"), await fleet.serve_tcp("good")]
            config = Config(
                upstreams=upstreams,
                listen="127.0.0.1:0",
                admin_listen="127.0.0.1:0",
                response_header_timeout=0.3,
            )
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(serve, config)
                url = f"ws://{bound.admin[0]}:{bound.admin[1]}/events"  # type: ignore[index]
                async with trio_websocket.open_websocket_url(url) as ws:
                    host, port = bound.client
                    stream = await trio.open_tcp_stream(host, port)
                    await stream.send_all(
                        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                        b"X-Request-Id: real-1\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
                    )
                    states = []
                    while not states or states[-1][0] not in TERMINAL:
                        event = json.loads(await ws.get_message())
                        if event["type"] == "workload":
                            assert event["id"] == "real-1"
                            states.append((event["state"], event["node"]))
                    await stream.aclose()
                nursery.cancel_scope.cancel()
    assert states == [
        ("queued", None),
        ("running", "frozen"),
        ("running", "good"),
        ("committed", "good"),
        ("completed", "good"),
    ]


async def test_the_ticker_runs_with_the_admin_listener_off(autojump_clock: trio.abc.Clock) -> None:
    # The ticker belongs to serve(), not to the admin API: with
    # --admin-listen off an idle proxy still says when a node is ready.
    async with Fleet({"frozen": FakeNode(frozen()), "good": FakeNode(healthy())}) as fleet:
        config = Config(
            upstreams=fleet.upstreams(),
            listen="127.0.0.1:0",
            admin_listen=None,
            response_header_timeout=10.0,
            discovery_interval=0,  # only the ticker's events here
        )
        proxy = Proxy(config, connector=fleet.connector)
        with proxy.events.subscribe(0) as subscription:
            async with trio.open_nursery() as nursery:
                addresses = await nursery.start(functools.partial(serve, config, proxy=proxy))
                assert addresses.admin is None
                await request(proxy, body=BODY)  # at 10 s: frozen cools until 20 s
                with trio.fail_after(60):  # virtual seconds: no ticker, no event
                    async for event in subscription:
                        if event["type"] == "node" and event["state"] == "ready":
                            break
                assert trio.current_time() == 20.0
                assert event["node"] == "frozen"
                assert event["reason"] == "expired"
                nursery.cancel_scope.cancel()
