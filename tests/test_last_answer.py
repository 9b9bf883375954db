"""When every attempt fails, the client gets the *last* retryable answer.

A mutation run (issue 27) relayed the first one instead and no test saw it
but through the 404 path: these mix two retryable statuses from two nodes,
in both orders, under ``MockClock`` over in-memory streams.
"""

from __future__ import annotations

import json

import pytest
import trio

from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.testing import FakeNode, Fleet, request, retry_status

BODY = json.dumps({"model": "m", "stream": True, "messages": []}).encode()

BUSY = b'{"error": {"message": "a is busy", "code": "overloaded"}}'
LIMITED = b'{"error": {"message": "b says slow down", "code": "rate_limited"}}'


def answers() -> dict[str, FakeNode]:
    return {
        "503": FakeNode(retry_status(503, BUSY, headers=(("x-answered-by", "busy"),))),
        "429": FakeNode(
            retry_status(429, LIMITED, headers=(("retry-after", "7"), ("x-answered-by", "limited")))
        ),
    }


@pytest.mark.parametrize(
    ("order", "status", "body", "answered_by"),
    [
        pytest.param(("503", "429"), 429, LIMITED, "limited", id="503-then-429"),
        pytest.param(("429", "503"), 503, BUSY, "busy", id="429-then-503"),
    ],
)
async def test_the_last_of_two_retryable_answers_is_relayed_as_sent(
    autojump_clock: trio.abc.Clock,
    order: tuple[str, str],
    status: int,
    body: bytes,
    answered_by: str,
) -> None:
    nodes = answers()
    async with Fleet({name: nodes[name] for name in order}) as fleet:
        proxy = Proxy(
            Config(upstreams=fleet.upstreams(), admin_listen=None), connector=fleet.connector
        )
        with trio.fail_after(60):
            response = await request(proxy, body=BODY)
    assert response is not None
    assert (response.status, response.body, response.complete) == (status, body, True)
    assert response.header("x-answered-by") == answered_by
    assert response.header("retry-after") == ("7" if status == 429 else None)
    assert response.header("x-failover-node") == order[1]
    assert response.header("x-failover-attempts") == "2"
    assert [len(node.received) for node in fleet.nodes.values()] == [1, 1]
    attempts = proxy.recent[-1]["attempts"]
    assert [(a["node"], a["outcome"]) for a in attempts] == [
        (order[0], "retryable_response"),
        (order[1], "retryable_response"),
    ]
