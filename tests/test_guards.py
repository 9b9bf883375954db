"""Behaviours a mutation run found unguarded (issue 21), each pinned by a test.

Every test here was seen failing once with the guarded line broken; the
docstring of each says which break it kills. All run the whole proxy over
in-memory streams under ``MockClock(autojump_threshold=0)``, with exact
virtual times, through the public API and the testing kit only.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

import attrs
import pytest
import trio
import trio.testing

from trio_failover import Config, Proxy, Upstream
from trio_failover.testing import (
    FakeNode,
    Fleet,
    frozen,
    healthy,
    request,
    retry_status,
    slow_head,
)

# Streamed: the response-header timeout bounds the wait for its head (an
# unstreamed request would wait --unstreamed-timeout).
BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
LIMIT = 1000.0  # virtual seconds any test here may take


def make_proxy(fleet: Fleet, **settings: object) -> Proxy:
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


def outcomes(proxy: Proxy) -> list[list[tuple[str, str]]]:
    """(node, outcome) per attempt, per finished workload."""
    return [[(a["node"], a["outcome"]) for a in w["attempts"]] for w in proxy.recent]


def states(proxy: Proxy) -> dict[str, str]:
    """Each node's state as ``/status`` shows it now."""
    return {node["name"]: node["state"] for node in proxy.status()["nodes"]}


# -- slow connects and slow readers -------------------------------------------


class LateReader(trio.abc.Stream):
    """A node's end of a connection that starts reading only after ``delay``.

    Over a lockstep pair the proxy's write of the request then lasts that
    long, as with a node whose accept queue or receive buffer is full.
    """

    def __init__(self, stream: trio.abc.Stream, delay: float) -> None:
        self._stream = stream
        self._delay = delay

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._delay:
            delay, self._delay = self._delay, 0.0
            await trio.sleep(delay)
        return bytes(await self._stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


class SlowConnector:
    """Connects to fake nodes in memory, slowly: ``connect_delay`` seconds per
    connect (TCP plus TLS, as the proxy sees it), and a node that starts
    reading a connection ``read_delay`` seconds after it was made."""

    def __init__(
        self,
        nodes: Mapping[str, FakeNode],
        nursery: trio.Nursery,
        *,
        connect_delay: float = 0.0,
        read_delay: float = 0.0,
    ) -> None:
        self._nodes = nodes
        self._nursery = nursery
        self._connect_delay = connect_delay
        self._read_delay = read_delay

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        await trio.sleep(self._connect_delay)
        proxy_side, node_side = trio.testing.lockstep_stream_pair()
        self._nursery.start_soon(
            self._nodes[node.name].serve_connection, LateReader(node_side, self._read_delay)
        )
        return proxy_side


async def slow_request(
    node: FakeNode, *, connect_delay: float = 0.0, read_delay: float = 0.0, **settings: object
) -> tuple[Proxy, int, float]:
    """One request to a proxy of the lone ``node`` behind a ``SlowConnector``.

    Returns the proxy, the status and the virtual time the answer ended.
    """
    async with trio.open_nursery() as nursery:
        connector = SlowConnector(
            {"n": node}, nursery, connect_delay=connect_delay, read_delay=read_delay
        )
        config = Config(
            upstreams=[Upstream("n", "http://n.invalid:80")],
            admin_listen=None,
            **settings,  # type: ignore[arg-type]
        )
        proxy = await nursery.start(
            functools.partial(Proxy(config, connector=connector).run, discovery=False)
        )
        response = await request(proxy, body=BODY)
        nursery.cancel_scope.cancel()
    assert response is not None
    return proxy, response.status, response.at


# Each pair kills one break: the header deadline started before the connect
# (at the attempt's start), or counted from the start of the write, not its
# end. The frozen node's attempt lasts from its start to the 504.
SLOW_CONNECT = {"connect_delay": 4.0, "connect_timeout": 5.0}
SLOW_READ = {"read_delay": 6.0}


@pytest.mark.parametrize(
    ("slowness", "behaviour", "status", "at"),
    [
        # Connect 0..4, written at 4, head due by 14: the 8 s prefill fits.
        pytest.param(SLOW_CONNECT, slow_head(8.0), 200, 12.0, id="connect-answers-in-time"),
        pytest.param(SLOW_CONNECT, frozen(), 504, 14.0, id="connect-frozen-times-out"),
        # The node takes the request at 6; head due by 16: 6 + 8 fits.
        pytest.param(SLOW_READ, slow_head(8.0), 200, 14.0, id="write-answers-in-time"),
        pytest.param(SLOW_READ, frozen(), 504, 16.0, id="write-frozen-times-out"),
    ],
)
async def test_the_header_deadline_starts_when_the_request_is_written(
    autojump_clock: trio.abc.Clock,
    slowness: dict[str, float],
    behaviour: object,
    status: int,
    at: float,
) -> None:
    """Neither the connect (with TLS) nor the write of the request counts against it."""
    with trio.fail_after(LIMIT):
        proxy, got, ended = await slow_request(
            FakeNode(behaviour),  # type: ignore[arg-type]
            response_header_timeout=10.0,
            **slowness,
        )
    assert (got, ended) == (status, at)
    if status == 504:
        (attempt,) = proxy.recent[0]["attempts"]
        assert (attempt["outcome"], attempt["elapsed_ms"]) == ("header_timeout", at * 1000)


async def test_a_node_that_never_takes_the_request_times_out_in_the_write(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Kills: an unbounded write (a node that reads nothing stalls the attempt forever)."""
    with trio.fail_after(LIMIT):
        proxy, got, ended = await slow_request(
            FakeNode(healthy()), read_delay=500.0, response_header_timeout=10.0
        )
    assert (got, ended) == (504, 10.0)
    (attempt,) = proxy.recent[0]["attempts"]
    assert attempt["outcome"] == "header_timeout"
    assert "request not taken" in attempt["detail"]


# -- only a 429 may demote with Retry-After -----------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_retry_after_on_a_status_other_than_429_does_not_demote(
    autojump_clock: trio.abc.Clock, status: int
) -> None:
    """Kills: any retryable status with ``Retry-After`` demoting its node."""
    busy = FakeNode(retry_status(status, headers=(("retry-after", "7"),)))
    with trio.fail_after(LIMIT):
        async with Fleet({"busy": busy, "peer": FakeNode(healthy(b"peer"))}) as fleet:
            # Cache affinity off: the same prompt, served by peer, would prefer it.
            proxy = make_proxy(fleet, affinity="off")
            first = await request(proxy, body=BODY)
            assert first is not None
            assert first.body == b"peer"
            assert states(proxy) == {"busy": "ready", "peer": "ready"}
            busy.behaviour = healthy(b"busy")
            second = await request(proxy, body=BODY)  # still first in line
            assert second is not None
            assert (second.body, second.at) == (b"busy", 0.0)


# -- model mappings on failover -----------------------------------------------


async def test_each_node_gets_its_own_model_name_after_a_failover(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Kills: a node's model name leaking into the request of the next node."""
    nodes = {
        "a": FakeNode(retry_status(503)),
        "b": FakeNode(retry_status(503)),
        "c": FakeNode(healthy(b"c")),
    }
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet:
            a, b, c = fleet.upstreams()
            upstreams = [
                attrs.evolve(a, models={"m": "a-name"}),
                b,  # no mapping: the client's own name
                attrs.evolve(c, models={"m": "c-name"}),
            ]
            config = Config(upstreams=upstreams, admin_listen=None)
            proxy = Proxy(config, connector=fleet.connector)
            response = await request(proxy, body=BODY)
            assert response is not None
            assert response.body == b"c"
    sent = {name: [r.json()["model"] for r in node.received] for name, node in nodes.items()}
    assert sent == {"a": ["a-name"], "b": ["m"], "c": ["c-name"]}


# -- the last retryable answer wins -------------------------------------------


async def test_of_two_retryable_answers_the_client_gets_the_last(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Kills: the first retryable answer kept instead of the last."""
    first = b'{"error": {"message": "busy", "code": "overloaded"}}'
    last = b'{"error": {"message": "slow down", "code": "rate_limited"}}'
    nodes = {
        "a": FakeNode(retry_status(503, first, headers=(("x-from", "a"),))),
        "b": FakeNode(retry_status(429, last, headers=(("x-from", "b"), ("retry-after", "3")))),
    }
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet:
            response = await request(make_proxy(fleet), body=BODY)
    assert response is not None
    assert (response.status, response.body) == (429, last)
    assert response.header("x-from") == "b"
    assert response.header("retry-after") == "3"
    assert response.header("x-failover-node") == "b"
    assert response.header("x-failover-attempts") == "2"


@pytest.mark.parametrize(
    ("order", "node"),
    [
        pytest.param(("stalls", "busy"), "busy", id="timeout-then-503"),
        pytest.param(("busy", "stalls"), "busy", id="503-then-timeout"),
    ],
)
async def test_a_retryable_answer_beats_a_timeout(
    autojump_clock: trio.abc.Clock, order: tuple[str, str], node: str
) -> None:
    """Kills: a timed-out attempt turning the answer into the proxy's own 504."""
    body = b'{"error": {"message": "busy", "code": "overloaded"}}'
    behaviours = {"stalls": frozen(), "busy": retry_status(503, body)}
    with trio.fail_after(LIMIT):
        async with Fleet({name: FakeNode(behaviours[name]) for name in order}) as fleet:
            proxy = make_proxy(fleet, response_header_timeout=5.0)
            response = await request(proxy, body=BODY)
    assert response is not None
    assert (response.status, response.body, response.at) == (503, body, 5.0)
    assert response.header("x-failover-node") == node
    assert sorted(outcome for _, outcome in outcomes(proxy)[0]) == [
        "header_timeout",
        "retryable_response",
    ]


# -- a cooldown demotes, it never excludes ------------------------------------


async def test_a_request_is_served_while_every_node_cools(autojump_clock: trio.abc.Clock) -> None:
    """Kills: cooling nodes left out of the candidates."""
    limited = retry_status(429, headers=(("retry-after", "60"),))
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(limited), "b": FakeNode(limited)}) as fleet:
            proxy = make_proxy(fleet)
            first = await request(proxy, body=BODY)
            assert first is not None
            assert first.status == 429
            assert states(proxy) == {"a": "cooling", "b": "cooling"}
            fleet["a"].behaviour = healthy(b"a")
            fleet["b"].behaviour = healthy(b"b")
            second = await request(proxy, body=BODY)
            assert second is not None
            # Both cool until 60: ranking order among them, served at once.
            assert (second.status, second.body, second.at) == (200, b"a", 0.0)
            assert second.header("x-failover-attempts") == "1"


async def test_a_cooling_node_is_tried_after_the_ready_ones_fail(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Kills: cooling nodes used only when no node is ready."""
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"b"))}) as fleet:
            proxy = make_proxy(fleet, response_header_timeout=10.0)
            first = await request(proxy, body=BODY)
            assert first is not None
            assert (first.body, first.at) == (b"b", 10.0)
            assert states(proxy) == {"a": "cooling", "b": "ready"}  # a until 20
            fleet["a"].behaviour = healthy(b"a")
            fleet["b"].behaviour = retry_status(503)
            second = await request(proxy, body=BODY)
            assert second is not None
            assert (second.status, second.body, second.at) == (200, b"a", 10.0)
            assert outcomes(proxy)[1] == [("b", "retryable_response"), ("a", "completed")]
