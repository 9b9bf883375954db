"""``RedisConnection.post``: commands written and not waited for, against a real redis-server.

The slot's release is posted (the take is the request path's one
round trip); its answer is read by the next call on the connection.
"""

from __future__ import annotations

import functools

import pytest
import trio
from conftest import RedisServer

from trio_failover.core.errors import StateError, StateTimeout, StateUnavailable
from trio_failover.core.redis_url import RedisAddress
from trio_failover.wire import http1
from trio_failover.wire.redis import RedisConnection, open_redis

LIMIT = 10.0


def soon() -> float:
    return trio.current_time() + 5.0


async def until_readable(redis: RedisConnection) -> None:
    """Until the posted answers are in the socket (what a gap between requests gives)."""
    await trio.lowlevel.wait_readable(redis._link.stream.socket.fileno())  # type: ignore[attr-defined]


async def test_posted_answers_go_to_their_callbacks_when_a_later_call_reads(
    redis_server: RedisServer,
) -> None:
    answers: list[list[object] | StateError] = []
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            assert await redis.post([("INCR", "n")], deadline=soon(), on_replies=answers.append)
            assert await redis.post(
                [("INCR", "n"), ("INCR", "n")], deadline=soon(), on_replies=answers.append
            )
            assert answers == []  # nobody read yet
            assert await redis.execute("GET", "n", deadline=soon()) == b"3"
            assert answers == [[1], [2, 3]]


async def answer_twice(stream: trio.SocketStream) -> None:
    """A server that answers the login's PING and one command more, then nothing."""
    async with stream:
        for reply in (b"+PONG\r\n", b"+OK\r\n"):
            await stream.receive_some()
            await stream.send_all(reply)
        while await stream.receive_some():
            pass


async def test_a_later_call_takes_posted_answers_in_without_a_wait_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A later call reads what already came before it waits: one wait, for its own reply.

    The server never answers the later call, so every wait it makes is counted.
    """
    waits = 0
    receive = http1.receive

    async def counted(stream: trio.abc.ReceiveStream, size: int = 65536) -> bytes:
        nonlocal waits
        waits += 1
        return await receive(stream, size)

    monkeypatch.setattr(http1, "receive", counted)
    answers: list[list[object] | StateError] = []
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, answer_twice, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            address = RedisAddress(host="127.0.0.1", port=port)
            async with await open_redis(address, deadline=soon()) as redis:
                assert await redis.post(
                    [("SET", "k", "v")], deadline=soon(), on_replies=answers.append
                )
                await until_readable(redis)
                waits = 0
                with pytest.raises(StateTimeout):
                    await redis.execute("GET", "k", deadline=trio.current_time() + 0.2)
                assert answers == [[b"OK"]]
                assert waits == 1
            nursery.cancel_scope.cancel()


async def test_a_post_in_a_cancelled_scope_still_goes_out(redis_server: RedisServer) -> None:
    answers: list[list[object] | StateError] = []
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            with trio.CancelScope() as scope:
                scope.cancel()
                assert await redis.post(
                    [("SET", "k", "v")], deadline=soon(), on_replies=answers.append
                )
            assert await redis.execute("GET", "k", deadline=soon()) == b"v"
            assert answers == [[b"OK"]]


async def test_a_lost_connection_tells_the_posted_callbacks(redis_server: RedisServer) -> None:
    answers: list[list[object] | StateError] = []
    with trio.fail_after(LIMIT):
        async with (
            await open_redis(redis_server.address, deadline=soon(), client_name="victim") as redis,
            await open_redis(redis_server.address, deadline=soon()) as admin,
        ):
            await admin.execute("CLIENT", "PAUSE", 2000, "ALL", deadline=soon())
            assert await redis.post([("PING",)], deadline=soon(), on_replies=answers.append)
            await admin.execute("CLIENT", "KILL", "SKIPME", "yes", deadline=soon())
            await admin.execute("CLIENT", "UNPAUSE", deadline=soon())
            with pytest.raises(StateUnavailable):
                await redis.execute("PING", deadline=soon())
            assert len(answers) == 1
            assert isinstance(answers[0], StateUnavailable)


async def test_nothing_is_posted_on_a_closed_connection_or_past_the_deadline(
    redis_server: RedisServer,
) -> None:
    answers: list[list[object] | StateError] = []
    with trio.fail_after(LIMIT):
        redis = await open_redis(redis_server.address, deadline=soon())
        past = trio.current_time() - 1
        assert not await redis.post([("PING",)], deadline=past, on_replies=answers.append)
        assert await redis.execute("PING", deadline=soon()) == b"PONG"
        await redis.aclose()
        assert not await redis.post([("PING",)], deadline=soon(), on_replies=answers.append)
        assert answers == []
