"""Answers without a body (204, 304, any answer to HEAD), through the whole proxy.

RFC 9110 section 8.6 and RFC 9112 section 6.3: a ``204`` never carries a
``Content-Length``; a ``304`` and an answer to ``HEAD`` may carry the length
a ``200`` to ``GET`` would have had; none of them has a body, whatever bytes
the node sends after its head. Those bytes must not reach this client (as
a body) nor the next one (as its answer): the pool closes the connection
they came on (``wire/pool.py``).

In-memory streams under the autojump clock, raw bytes on the client side.
"""

from __future__ import annotations

import h11
import pytest
import trio
from test_client_limits import exchange, make_proxy

from trio_failover.testing import Behaviour, FakeNode, Fleet, NodeIO, ReceivedRequest

STRAY = b"hello"  # what a careless node sends after a bodiless answer


def bodiless_then_stray(status: int) -> Behaviour:
    """Answers ``/first`` with ``status``, ``Content-Length: 5`` and 5 stray bytes;
    anything else with a plain ``200``."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if request.target == b"/first":
            head = h11.Response(
                status_code=status, headers=[(b"content-length", b"5"), (b"x-node", b"a")]
            )
            # One write: the stray bytes come in the same read as the head.
            data = b"".join(io.conn.send(event) or b"" for event in (head, h11.EndOfMessage()))
            await io.send_raw(data + STRAY)
        else:
            body = b"next answer"
            head = h11.Response(status_code=200, headers=[(b"content-length", b"%d" % len(body))])
            await io.send(head, h11.Data(data=body), h11.EndOfMessage())

    return behave


def _get(method: bytes, path: bytes) -> bytes:
    return method + b" " + path + b" HTTP/1.1\r\nHost: proxy.test\r\n\r\n"


@pytest.mark.parametrize(
    ("status", "method", "length"),
    [
        pytest.param(204, b"GET", None, id="204-no-length"),
        pytest.param(304, b"GET", b"5", id="304-keeps-length"),
        pytest.param(200, b"HEAD", b"5", id="head-keeps-length"),
    ],
)
async def test_a_bodiless_answer_reaches_the_client_empty_and_its_stray_bytes_nowhere(
    autojump_clock: trio.testing.MockClock, status: int, method: bytes, length: bytes | None
) -> None:
    async with Fleet({"a": FakeNode(bodiless_then_stray(status))}) as fleet:
        proxy = make_proxy(fleet, keepalive_timeout=5.0)
        result = await exchange(
            proxy,
            [_get(method, b"/first"), _get(b"GET", b"/second")],
            pause=1.0,
            methods=[method, b"GET"],
        )
        first, second = result.responses
        assert first.status == status
        assert first.header("content-length") == length
        assert first.header("transfer-encoding") is None
        assert first.header("x-node") == b"a"
        assert first.body == b""
        # The next answer on the client's connection is the node's own, not
        # the stray bytes read as a response.
        assert (second.status, second.body) == (200, b"next answer")
        assert STRAY not in b"".join(data for _, data in result.raw)
        assert fleet["a"].connections == 2  # the first connection was never reused
        strays = proxy.metrics.registry.get_sample_value(
            "trio_failover_stray_bytes_total", {"node": "a"}
        )
        assert strays == 1
