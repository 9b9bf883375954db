"""The stream-idle timer (SilenceTimer, SilenceWatch): exact virtual times, the relay's notes
set by hand, and a whole proxy with the watch running."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import trio

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.proxy.nodes.silence import SilenceTimer, SilenceWatch
from trio_failover.testing import (
    FakeNode,
    Fleet,
    request,
    slow_prefill_with_pings,
    stream_then_silence,
)

LIMIT = 3600.0  # virtual seconds: every test ends long before


async def fired_at(timer: SilenceTimer, relay: object) -> float | None:
    """Time ``relay`` (a coroutine function of the timer) by a watch; when it fired."""
    watch = SilenceWatch()

    async def register() -> None:
        # Once the relay waits, its notes set (as a relay sets them before
        # each wait for the node).
        watch.register(timer)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.watch)
        nursery.start_soon(register)
        try:
            with trio.fail_after(LIMIT), timer.scope:
                await relay(timer)  # type: ignore[operator]
        finally:
            watch.unregister(timer)
        nursery.cancel_scope.cancel()
    return trio.current_time() if timer.fired else None


async def test_fires_a_timeout_after_the_wait_began(autojump_clock: trio.abc.Clock) -> None:
    async def relay(timer: SilenceTimer) -> None:
        await trio.sleep(7.0)  # writing: not the node's silence
        timer.waiting_since = trio.current_time()
        await trio.sleep_forever()

    assert await fired_at(SilenceTimer(10.0, armed=True), relay) == 17.0


async def test_never_fires_while_the_relay_writes(autojump_clock: trio.abc.Clock) -> None:
    async def relay(timer: SilenceTimer) -> None:
        timer.waiting_since = None
        await trio.sleep(50.0)  # a write to a slow client, five timeouts long
        assert not timer.fired
        timer.waiting_since = trio.current_time()
        await trio.sleep_forever()

    assert await fired_at(SilenceTimer(10.0, armed=True), relay) == 60.0


async def test_earlier_silence_counts(autojump_clock: trio.abc.Clock) -> None:
    async def relay(timer: SilenceTimer) -> None:
        timer.silence = 4.0  # pings only since the last progress, 4 s of waiting
        timer.waiting_since = trio.current_time()
        await trio.sleep_forever()

    assert await fired_at(SilenceTimer(10.0, armed=True), relay) == 6.0


async def test_unarmed_it_waits_without_bound(autojump_clock: trio.abc.Clock) -> None:
    async def relay(timer: SilenceTimer) -> None:
        timer.waiting_since = trio.current_time()
        await trio.sleep(1000.0)  # a long prefill with pings: never cut
        assert not timer.fired
        timer.armed, timer.waiting_since = True, trio.current_time()  # the first event
        await trio.sleep_forever()

    assert await fired_at(SilenceTimer(10.0, armed=False), relay) == 1010.0


async def test_stop_ends_it_without_firing(autojump_clock: trio.abc.Clock) -> None:
    async def relay(timer: SilenceTimer) -> None:
        timer.waiting_since = trio.current_time()
        await trio.sleep(9.0)

    assert await fired_at(SilenceTimer(10.0, armed=True), relay) is None
    assert trio.current_time() == 9.0


# -- several streams, one watch task -----------------------------------------------------------

Relay = Callable[[SilenceTimer], Awaitable[None]]


async def timed_stream(
    watch: SilenceWatch,
    timer: SilenceTimer,
    relay: Relay,
    fired: dict[str, float],
    name: str,
) -> None:
    """One stream as ``_stream_rest`` runs it: timed by ``watch``."""
    with trio.fail_after(LIMIT):
        assert watch.running
        watch.register(timer)
        try:
            with timer.scope:
                await relay(timer)
        finally:
            watch.unregister(timer)
    if timer.fired:
        fired[name] = trio.current_time()


async def run_streams(
    streams: list[tuple[str, float, Relay, float]],
) -> tuple[dict[str, float], SilenceWatch]:
    """Run (name, timeout, relay, start) streams side by side; when each one fired."""
    watch = SilenceWatch()
    fired: dict[str, float] = {}
    async with trio.open_nursery() as outer:
        outer.start_soon(watch.watch)
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            for name, seconds, relay, start in streams:
                nursery.start_soon(one_stream, watch, name, seconds, relay, start, fired)
        outer.cancel_scope.cancel()
    return fired, watch


async def one_stream(
    watch: SilenceWatch,
    name: str,
    seconds: float,
    relay: Relay,
    start: float,
    fired: dict[str, float],
) -> None:
    await trio.sleep_until(start)
    timer = SilenceTimer(seconds, armed=True)
    await timed_stream(watch, timer, relay, fired, name)


async def wait_forever(timer: SilenceTimer) -> None:
    timer.waiting_since = trio.current_time()
    await trio.sleep_forever()


async def test_timeouts_are_reached_in_order(autojump_clock: trio.abc.Clock) -> None:
    streams: list[tuple[str, float, Relay, float]] = [
        ("c", 30.0, wait_forever, 0.0),
        ("a", 10.0, wait_forever, 0.0),
        ("b", 20.0, wait_forever, 0.0),
        ("d", 30.0, wait_forever, 5.0),
    ]
    fired, _ = await run_streams(streams)
    assert fired == {"a": 10.0, "b": 20.0, "c": 30.0, "d": 35.0}
    assert list(fired) == ["a", "b", "c", "d"]


async def test_a_stream_that_ends_is_not_timed_any_more(autojump_clock: trio.abc.Clock) -> None:
    async def ends(timer: SilenceTimer) -> None:
        timer.waiting_since = trio.current_time()
        await trio.sleep(9.0)  # its stream ends, one second before its timeout

    streams: list[tuple[str, float, Relay, float]] = [
        ("ends", 10.0, ends, 0.0),
        ("stays", 50.0, wait_forever, 0.0),
    ]
    fired, watch = await run_streams(streams)
    assert fired == {"stays": 50.0}
    assert watch.timed == 0


async def test_many_ended_streams_leave_the_heap(autojump_clock: trio.abc.Clock) -> None:
    watch = SilenceWatch()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.watch)
        await trio.testing.wait_all_tasks_blocked()
        timers = [SilenceTimer(300.0, armed=True) for _ in range(1000)]
        for timer in timers:
            watch.register(timer)
        for timer in timers[:900]:
            watch.unregister(timer)
        assert watch.timed == 100
        assert len(watch._heap) < 500  # rebuilt without the ended ones, long before 300 s
        nursery.cancel_scope.cancel()


async def test_a_write_to_a_slow_client_never_counts(autojump_clock: trio.abc.Clock) -> None:
    async def writes_slowly(timer: SilenceTimer) -> None:
        for _ in range(3):
            timer.waiting_since = trio.current_time()
            await trio.sleep(4.0)  # the node's chunk comes after 4 s of 10
            timer.waiting_since, timer.silence = None, 0.0
            await trio.sleep(25.0)  # the client reads it slowly
        timer.waiting_since = trio.current_time()
        await trio.sleep_forever()

    streams: list[tuple[str, float, Relay, float]] = [
        ("slow client", 10.0, writes_slowly, 0.0),
        ("other", 200.0, wait_forever, 0.0),
    ]
    fired, _ = await run_streams(streams)
    assert fired == {"slow client": 3 * 29.0 + 10.0, "other": 200.0}


async def test_a_new_stream_with_an_earlier_expiry_wakes_the_watcher(
    autojump_clock: trio.abc.Clock,
) -> None:
    streams: list[tuple[str, float, Relay, float]] = [
        ("long", 1000.0, wait_forever, 0.0),
        ("short", 5.0, wait_forever, 1.0),  # registered while the watcher sleeps until 1000
    ]
    fired, _ = await run_streams(streams)
    assert fired == {"short": 6.0, "long": 1000.0}


async def test_a_short_wait_costs_no_heap_entry_and_a_long_one_is_timed_exactly(
    autojump_clock: trio.abc.Clock,
) -> None:
    watch = SilenceWatch()
    fired: dict[str, float] = {}

    async def short(timer: SilenceTimer) -> None:
        timer.waiting_since = trio.current_time()
        await trio.sleep(2.0)  # its answer came long before a timeout
        assert [entry[2] for entry in watch._heap] == [first]  # noted, never queued

    first = SilenceTimer(30.0, armed=True)
    async with trio.open_nursery() as outer:
        outer.start_soon(watch.watch)
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timed_stream, watch, first, wait_forever, fired, "first")
            await trio.sleep(1.0)
            await timed_stream(watch, SilenceTimer(30.0, armed=True), short, fired, "short")
            await trio.sleep(2.0)  # t=5: one that is still waiting at the watch's next scan
            await timed_stream(watch, SilenceTimer(30.0, armed=True), wait_forever, fired, "late")
        outer.cancel_scope.cancel()
    assert fired == {"first": 30.0, "late": 35.0}


# -- a whole proxy, the watch one of its own tasks ---------------------------------------------

STREAMED = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


async def test_a_stalled_stream_times_out_under_the_watch(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"quiet": FakeNode(stream_then_silence(2, 600)), "peer": FakeNode()}) as fleet:
        # No checks: the peer must see no request at all.
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, discovery_interval=0)
        proxy = Proxy(config, connector=fleet.connector)
        async with proxy, trio.open_nursery() as nursery:
            assert proxy.silence.running
            results = []

            async def client() -> None:
                results.append(await request(proxy, body=STREAMED))

            with trio.fail_after(LIMIT):
                async with trio.open_nursery() as clients:
                    clients.start_soon(client)
                    await trio.sleep(100.0)  # virtual: in the node's silence
                    assert proxy.silence.timed == 1  # the watch times it, no task of its own
            (response,) = results
            assert response is not None
            assert not response.complete
            assert response.at == 300.0  # commit at 0 + five minutes of silence
            assert proxy.cooldowns.is_cooling("quiet", trio.current_time())
            assert fleet["peer"].received == []
            assert proxy.silence.timed == 0
            nursery.cancel_scope.cancel()


async def test_pings_after_the_first_token_time_out_under_the_watch(
    autojump_clock: trio.abc.Clock,
) -> None:
    stuck = FakeNode(slow_prefill_with_pings(20.0, stuck_after=1))
    async with Fleet({"stuck": stuck}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        async with proxy, trio.open_nursery() as nursery:
            assert proxy.silence.running
            with trio.fail_after(LIMIT):
                response = await request(proxy, body=STREAMED)
            assert response is not None
            assert not response.complete
            assert response.at == 20.0 + 300.0
            nursery.cancel_scope.cancel()
