"""The stream-idle timer (SilenceTimer): exact virtual times, the relay's notes set by hand."""

from __future__ import annotations

import trio

from trio_failover.proxy.silence import SilenceTimer

LIMIT = 3600.0  # virtual seconds: every test ends long before


async def fired_at(timer: SilenceTimer, relay: object) -> float | None:
    """Run the timer beside ``relay`` (a coroutine function of the timer); when it fired."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timer.run)
        with trio.fail_after(LIMIT), timer.scope:
            await relay(timer)  # type: ignore[operator]
        timer.stop()
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
