"""A frozen node costs seconds with the default settings: silence is a question.

Whole proxies over in-memory streams under ``MockClock(autojump_threshold=0)``,
with the defaults (``--response-header-timeout`` 120 s, ``--liveness-interval``
10 s, a check's head within min(10 s, 120 s)), so each instant is exact:

    t=0    the request is written; the node (SIGSTOPped) says nothing
    t=10   a whole interval of silence: GET /health on a connection of its own
    t=20   no head for the check: the node is down (unresponsive), every
           wait on it ends now, the next candidate gets the request
"""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio
from test_liveness import LIMIT, STREAMED, UNSTREAMED, outcomes, status_of
from test_liveness import check_times as health_times

from trio_failover import Config
from trio_failover.core.node_change import NodeChange
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    FakeNode,
    Fleet,
    ReceivedRequest,
    frozen,
    frozen_mid_stream,
    healthy,
    request,
    slow_prefill,
)
from trio_failover.testing.fakes import NodeIO, is_health


def make_proxy(fleet: Fleet, **settings: Any) -> Proxy:
    """The defaults but for the admin listener (and discovery, off unless asked)."""
    settings.setdefault("discovery_interval", 0)
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)
    return Proxy(config, connector=fleet.connector)


@pytest.mark.parametrize("body", [STREAMED, UNSTREAMED], ids=["streamed", "unstreamed"])
async def test_a_frozen_node_costs_one_interval_and_one_check_with_the_defaults(
    autojump_clock: trio.abc.Clock, body: bytes
) -> None:
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=body)
        assert response is not None
        assert (response.status, response.body) == (200, b"from b")
        assert response.at == 20.0  # not 120 s, nor the unstreamed 600 s
        assert response.header("x-failover-attempts") == "2"
        assert health_times(fleet["a"]) == [10.0]
        assert outcomes(proxy) == [[("a", "unresponsive"), ("b", "completed")]]
        a = status_of(proxy, "a")
        assert (a["state"], a["reason"], a["last_check"]["ok"]) == ("down", "unresponsive", False)


async def test_a_down_mark_ends_every_waiting_attempt_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Another workload's check finds the node silent: the waits that asked nothing end too."""
    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet)
        answers: list[tuple[float, bytes]] = []

        async def one(delay: float) -> None:
            await trio.sleep(delay)
            response = await request(proxy, body=STREAMED)
            assert response is not None
            answers.append((response.at, response.body))

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0.0)  # asks at 10; its check fails at 20
                nursery.start_soon(one, 5.0)  # would ask at 15: joins; ends at 20 too
                nursery.start_soon(one, 15.0)  # silent 5 s only: ended by the down mark
        assert answers == [(20.0, b"from b")] * 3
        assert health_times(fleet["a"]) == [10.0]


async def test_a_discovery_check_that_finds_the_node_down_ends_the_waits_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Discovery's own verdict (a 5xx from /health) is a down mark like any other."""
    healths = 0

    async def sick_later(io: NodeIO, request: ReceivedRequest) -> None:
        nonlocal healths
        if is_health(request):
            healths += 1
            status = 200 if healths == 1 else 503  # up at start, then its engine fails
            await healthy(b"{}", status=status)(io, request)
            return
        await io.wait_closed()  # its requests hang

    async with Fleet({"a": FakeNode(sick_later), "b": FakeNode(healthy(b"from b"))}) as fleet:
        proxy = make_proxy(fleet, discovery_interval=5.0, liveness_interval=0)
        async with proxy:
            answers: list[float] = []

            async def one() -> None:
                response = await request(proxy, body=STREAMED)
                assert response is not None
                assert response.body == b"from b"
                answers.append(response.at)

            with trio.fail_after(LIMIT):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(one)
                    nursery.start_soon(one)
            checks = health_times(fleet["a"])
            assert len(checks) >= 2
            # Both ended the moment the second check answered 503, together.
            assert answers == [checks[1], checks[1]]
            assert checks[1] < 10.0  # long before any deadline
            assert status_of(proxy, "a")["reason"] == "health_check"


async def test_a_stream_frozen_after_commit_ends_after_one_interval_and_one_check(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen_mid_stream(3)), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.status == 200
        assert not response.complete  # cut: no terminating chunk, an error at the client
        assert response.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert response.at == 20.0  # not the 5-minute stream-idle timeout
        assert health_times(fleet["a"]) == [10.0]
        assert outcomes(proxy) == [[("a", "unresponsive")]]
        assert fleet["b"].received == []  # nothing is replayed after commit
        assert status_of(proxy, "a")["state"] == "down"


async def test_a_stream_silent_at_a_node_marked_down_just_after_its_last_byte_ends_at_a_question(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Marked down while its last byte was recent, the stream was alive; silent a period, it ends.

    The mark (discovery's check answered 503 at 5 s) comes within the proof
    window of the byte at 0 s, so it ends nothing then; at 10 s the
    stream's silence comes to a question, and the node is still down: the
    stream ends there, not at the 5-minute stream-idle timeout (a check
    would pass: a 503 is an answer).
    """
    healths = 0

    async def one_event_then_silence(io: NodeIO, received: ReceivedRequest) -> None:
        nonlocal healths
        if is_health(received):
            healths += 1
            await healthy(b"{}", status=200 if healths == 1 else 503)(io, received)
            return
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        )
        await io.send(h11.Data(data=b"data: 0\n\n"))
        await io.wait_closed()

    async with Fleet({"a": FakeNode(one_event_then_silence)}) as fleet:
        proxy = make_proxy(fleet, discovery_interval=5.0)
        async with proxy:
            with trio.fail_after(LIMIT):
                response = await request(proxy, body=STREAMED)
            assert response is not None
            assert (response.status, response.complete) == (200, False)
            assert response.body == b"data: 0\n\n"
            checks = health_times(fleet["a"])
            assert 0.0 < checks[1] < 10.0  # down then, within the proof window of the byte
            assert response.at == 10.0
            assert outcomes(proxy) == [[("a", "unresponsive")]]
            assert status_of(proxy, "a")["reason"] == "health_check"


async def test_a_node_whose_health_answers_keeps_a_long_prefill(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(slow_prefill(25.0, b"whole")), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"whole", 25.0)
        assert response.header("x-failover-attempts") == "1"
        assert health_times(fleet["a"]) == [10.0, 20.0]  # asked, answered, kept
        assert fleet["b"].received == []
        assert status_of(proxy, "a")["state"] == "ready"


def _stream_every(seconds: float, count: int, *, health: bool) -> Any:
    """A node that streams a chunk every ``seconds``; its /health hangs unless ``health``."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if is_health(request):
            if health:
                await healthy(b"{}")(io, request)
            else:
                await io.wait_closed()
            return
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        )
        for index in range(count):
            await io.send(h11.Data(data=b"data: %d\n\n" % index))
            await io.pause(seconds)
        await io.send(h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())

    return behave


async def test_a_timed_out_check_during_a_moving_stream_does_not_count(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A node busy streaming may answer its health route slowly: bytes prove it alive."""
    node = FakeNode(_stream_every(1.0, 40, health=False))
    async with Fleet({"a": node}) as fleet:
        proxy = make_proxy(fleet, discovery_interval=30.0, liveness_interval=0)
        async with proxy:
            with trio.fail_after(LIMIT):
                response = await request(proxy, body=STREAMED)
            assert response is not None
            assert response.complete
            assert response.at == 40.0
            assert len(health_times(node)) >= 1  # discovery asked, and timed out
            assert status_of(proxy, "a")["state"] == "ready"


async def test_a_timed_out_check_during_a_silent_stream_counts(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A stream that stopped proves nothing: discovery's timed-out check marks the node down."""
    async with Fleet({"a": FakeNode(frozen_mid_stream(2))}) as fleet:
        proxy = make_proxy(fleet, discovery_interval=30.0, liveness_interval=0)
        async with proxy:
            with trio.fail_after(LIMIT):
                response = await request(proxy, body=STREAMED)
            assert response is not None
            assert not response.complete
            first_check = health_times(fleet["a"])[0]
            # Discovery's check waits 10 s for its answer; the stream, silent
            # since 0, is no proof then: down, and the stream ends with it.
            assert response.at == first_check + 10.0
            assert status_of(proxy, "a")["reason"] == "health_check"
            assert outcomes(proxy) == [[("a", "unresponsive")]]


async def test_a_node_down_by_a_check_is_back_within_seconds_of_waking(
    autojump_clock: trio.abc.Clock,
) -> None:
    """With discovery off, the checker itself asks a node it marked down again: 1, 2, 4 s..."""
    awake = trio.Event()

    async def wakes(io: NodeIO, request: ReceivedRequest) -> None:
        if awake.is_set():
            await healthy(b"awake")(io, request)
        else:
            await io.wait_closed()

    async with Fleet({"a": FakeNode(wakes), "b": FakeNode(healthy(b"from b"))}) as fleet:
        # Cache affinity off: the same prompt, served by b while a was down,
        # would prefer b; this test wants the priority order back.
        proxy = make_proxy(fleet, affinity="off")
        ready = trio.Event()
        proxy.board.listen(
            lambda change: (
                ready.set()
                if isinstance(change, NodeChange) and change.kind.value == "ready"
                else None
            )
        )
        async with proxy:
            with trio.fail_after(LIMIT):
                response = await request(proxy, body=STREAMED)
                assert response is not None
                assert (response.body, response.at) == (b"from b", 20.0)
                assert status_of(proxy, "a")["state"] == "down"
                await trio.sleep_until(30.0)
                awake.set()  # kill -CONT
                await ready.wait()
                back = trio.current_time()
                later = await request(proxy, body=STREAMED)
            assert later is not None
            assert later.body == b"awake"
        # Each failed check waits 10 s for its head; then 1 s, 2 s ... until
        # the next: 21 (fails at 31), 33, after the wake at 30: back.
        assert health_times(fleet["a"])[:3] == [10.0, 21.0, 33.0]
        assert back == 33.0
