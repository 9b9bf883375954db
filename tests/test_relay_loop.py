"""The relay loop after commit and its idle silence (proxy/request/relay.py, nodes/silence.py).

Two cases a mutation run found untested (issue 27): a chunk that arrives in
the very pass in which the idle timer fires, and an event stream whose
pings, gap after gap, would add up to the timeout if an event did not end
the silence. The first is a unit test of ``_relay_chunks`` with a stand-in
node response and client; the second runs the whole proxy under
``MockClock``, with the one ``SilenceWatch`` task and with a timer task per
stream.
"""

from __future__ import annotations

import json
from typing import Any, cast

import h11
import pytest
import trio
import trio.testing

from trio_failover import Config
from trio_failover.core.sse import SseScanner
from trio_failover.core.usage import Body, UsageReader
from trio_failover.proxy import Proxy
from trio_failover.proxy.nodes.silence import SilenceTimer
from trio_failover.proxy.request.relay import _relay_chunks
from trio_failover.testing import FakeNode, Fleet, NodeIO, ReceivedRequest, request

LIMIT = 3600.0  # virtual seconds: every test ends long before

STREAMED = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


# -- the loop itself: a receive that cancels the timer ---------------------------------------


class ScriptedResponse:
    """The part of ``UpstreamResponse`` the relay loop uses: chunks by script.

    Each step is ``(chunk, fire)``: ``fire`` cancels the timer's scope inside
    the receive, just before the chunk is returned, as the timer does when
    its deadline passes in the same scheduler pass in which the chunk came.
    """

    def __init__(self, timer: SilenceTimer, steps: list[tuple[bytes, bool]], *, sse: bool) -> None:
        self.timer = timer
        self.steps = list(steps)
        self.complete = False
        self.scanner = SseScanner() if sse else None

    async def receive_chunk(self) -> bytes:
        await trio.lowlevel.checkpoint()
        chunk, fire = self.steps.pop(0)
        if fire:
            self.timer.scope.cancel()
        self.complete = not self.steps
        return chunk


class RecordingClient:
    """The part of ``ClientConnection`` the relay loop writes to."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.ended = False

    async def send_data(self, data: bytes) -> None:
        self.sent.append(data)
        await trio.lowlevel.checkpoint()

    async def send(self, *events: h11.Event) -> None:
        for event in events:
            if isinstance(event, h11.Data):
                self.sent.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.ended = True
        await trio.lowlevel.checkpoint()


class Work:
    """The part of a ``Workload`` the relay loop tells: the bytes sent."""

    body_bytes = 0

    def sent(self, count: int) -> None:
        self.body_bytes += count


async def relay(steps: list[tuple[bytes, bool]], *, sse: bool) -> tuple[bool, RecordingClient, int]:
    timer = SilenceTimer(10.0, armed=True)
    response = ScriptedResponse(timer, steps, sse=sse)
    client = RecordingClient()
    work = Work()
    with trio.fail_after(LIMIT):
        relayed = await _relay_chunks(
            cast(Any, client),
            cast(Any, work),
            cast(Any, response),
            timer,
            None,
            UsageReader(Body.WHOLE),
        )
    return relayed, client, work.body_bytes


@pytest.mark.parametrize("sse", [False, True], ids=["plain", "event-stream"])
@pytest.mark.parametrize("last", [False, True], ids=["mid-body", "last-chunk"])
async def test_a_chunk_that_comes_as_the_timer_fires_is_not_relayed(sse: bool, last: bool) -> None:
    # The stream timed out at its deadline: what came in the same pass is too
    # late, even when it would have ended the body (a complete answer for a
    # stream the proxy books as timed out would be a lie either way).
    steps = [(b"data: 1\n\n", False), (b"data: late\n\n", True)]
    if not last:
        steps.append((b"data: 3\n\n", False))
    relayed, client, body_bytes = await relay(steps, sse=sse)
    assert relayed is False
    assert client.sent == [b"data: 1\n\n"]
    assert not client.ended
    assert body_bytes == len(b"data: 1\n\n")


async def test_the_same_chunks_without_the_timer_are_relayed_whole() -> None:
    steps = [(b"data: 1\n\n", False), (b"data: 2\n\n", False)]
    relayed, client, body_bytes = await relay(steps, sse=True)
    assert relayed is True
    assert client.sent == [b"data: 1\n\n", b"data: 2\n\n"]
    assert client.ended
    assert body_bytes == 2 * len(b"data: 1\n\n")


# -- a whole proxy: pings over several gaps between events -----------------------------------

IDLE = 10.0  # --stream-idle-timeout of these tests


def pings_between_events(gaps: int) -> Any:
    """An event stream: an event, then ``gaps`` times (ping at +4 s, ping at +8 s, event at +9 s).

    Each gap is 9 s of which 8 s are pings only: under the 10 s idle timeout.
    The pings of all gaps together (8 s each) are far over it.
    """

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        head = [(b"content-type", b"text/event-stream")]
        await io.send(h11.Response(status_code=200, headers=head))
        await io.send(h11.Data(data=b"data: 0\n\n"))
        for gap in range(1, gaps + 1):
            await io.pause(4.0)
            await io.send(h11.Data(data=b": ping\n\n"))
            await io.pause(4.0)
            await io.send(h11.Data(data=b": ping\n\n"))
            await io.pause(1.0)
            await io.send(h11.Data(data=b"data: %d\n\n" % gap))
        await io.send(h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())

    return behave


async def test_an_event_ends_the_ping_only_silence(autojump_clock: trio.abc.Clock) -> None:
    gaps = 4
    async with Fleet({"a": FakeNode(pings_between_events(gaps)), "b": FakeNode()}) as fleet:
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, stream_idle_timeout=IDLE)
        proxy = Proxy(config, connector=fleet.connector)
        with trio.fail_after(LIMIT):  # the silence watch is one of the proxy's tasks
            response = await request(proxy, body=STREAMED)
    assert response is not None
    assert response.complete
    assert response.at == gaps * 9.0
    events = [line for line in response.body.split(b"\n\n") if line.startswith(b"data:")]
    assert events == [b"data: %d" % index for index in range(gaps + 1)] + [b"data: [DONE]"]
    assert not proxy.cooldowns.is_cooling("a", trio.current_time())
    assert [attempt["outcome"] for attempt in proxy.recent[-1]["attempts"]] == ["completed"]
