"""``wire.upstream.open_response`` called without a ``Progress``: a scope of its own.

The proxy's attempts pass their silence timer, whose scope carries the
head's deadline (tests/test_failover.py times that); a caller that passes
none still gets the head's timeout, as ``HeaderTimeout`` at the exact
virtual time, and an answer within it.
"""

from __future__ import annotations

import pytest
import trio

from trio_failover import Config
from trio_failover.core.errors import HeaderTimeout
from trio_failover.testing import FakeNode, Fleet, frozen, healthy
from trio_failover.wire.upstream import OutgoingRequest, open_response

REQUEST = OutgoingRequest(
    method=b"POST",
    target=b"/v1/chat/completions",
    headers=[(b"host", b"a"), (b"content-length", b"2")],
    body=b"{}",
)


async def test_a_silent_node_times_out_at_the_head_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(frozen())}) as fleet:
        config = Config(upstreams=fleet.upstreams(), response_header_timeout=7.0)
        node = config.upstreams[0]
        with pytest.raises(HeaderTimeout) as caught:
            await open_response(node, REQUEST, connector=fleet.connector, config=config)
        assert trio.current_time() == 7.0
        assert caught.value.phase == "head"
        assert str(caught.value) == "a: head: no complete response head in 7.0s"


async def test_an_answer_within_the_deadline_commits(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode(healthy(b"ok", head_delay=6.0))}) as fleet:
        config = Config(upstreams=fleet.upstreams(), response_header_timeout=7.0)
        response = await open_response(
            config.upstreams[0], REQUEST, connector=fleet.connector, config=config
        )
        assert response.status == 200
        assert response.first_chunk == b"ok"
        await response.aclose()
