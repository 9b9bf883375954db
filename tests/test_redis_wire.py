"""wire/redis.py against a real redis-server (the ``redis_server`` fixture of conftest.py).

Real 127.0.0.1 sockets and the real clock (no autojump: real I/O is in
flight). Deadlines are short and asserted with a margin for a busy machine;
every test is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
import trustme
from conftest import RedisServer, free_port

from trio_failover.core.errors import StateReplyError, StateTimeout, StateUnavailable
from trio_failover.core.redis_url import RedisAddress, parse_redis_url
from trio_failover.wire.redis import (
    Message,
    RedisConnection,
    Script,
    open_redis,
    open_subscription,
)

LIMIT = 10.0  # seconds for a whole test
SLACK = 1.0  # how late a deadline may fire on a busy two-core machine


def soon(seconds: float = 5.0) -> float:
    """A deadline ``seconds`` from now."""
    return trio.current_time() + seconds


async def test_commands_and_replies(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            assert await redis.execute("SET", "k", "v", deadline=soon()) == b"OK"
            assert await redis.execute("GET", "k", deadline=soon()) == b"v"
            assert await redis.execute("GET", "missing", deadline=soon()) is None
            assert await redis.execute("INCRBY", "n", 5, deadline=soon()) == 5
            assert await redis.execute("RPUSH", "l", b"\x00\xff", 2.5, deadline=soon()) == 2
            assert await redis.execute("LRANGE", "l", 0, -1, deadline=soon()) == [
                b"\x00\xff",
                b"2.5",
            ]


async def test_pipeline_answers_in_order_and_raises_the_first_error_after_reading_all(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            replies = await redis.pipeline(
                [("SET", "a", 1), ("INCR", "a"), ("GET", "a")], deadline=soon()
            )
            assert replies == [b"OK", 2, b"2"]
            with pytest.raises(StateReplyError) as caught:
                await redis.pipeline(
                    [("INCR", "a"), ("LPUSH", "a", 1), ("INCR", "a")], deadline=soon()
                )
            assert caught.value.code == "WRONGTYPE"
            assert caught.value.operation == "pipeline"
            # All three ran and were read: the connection is still in step.
            assert await redis.execute("GET", "a", deadline=soon()) == b"4"


async def test_error_replies_are_state_reply_errors(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            with pytest.raises(StateReplyError) as caught:
                await redis.execute("NOSUCHCOMMAND", deadline=soon())
            assert caught.value.code == "ERR"
            assert caught.value.operation == "NOSUCHCOMMAND"
            assert await redis.execute("PING", deadline=soon()) == b"PONG"


async def test_many_tasks_share_one_connection_and_each_gets_its_own_reply(
    redis_server: RedisServer,
) -> None:
    """Callers that give up leave their replies on the wire: the others still get their own.

    The abandoned calls are BLPOPs that the server answers only after 50 ms
    (it runs one connection's commands in order, so every later GET's reply
    comes after theirs); they are cancelled once every task waits.
    """
    got: dict[int, object] = {}
    scopes: list[trio.CancelScope] = []
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            await redis.pipeline([("SET", f"key{i}", i) for i in range(60)], deadline=soon())

            async def get(index: int) -> None:
                got[index] = await redis.execute("GET", f"key{index}", deadline=soon())

            async def abandoned() -> None:
                with trio.CancelScope() as scope:
                    scopes.append(scope)
                    await redis.execute("BLPOP", "nothing", 0.05, deadline=soon())
                assert scope.cancelled_caught

            async def too_late() -> None:
                with pytest.raises(StateTimeout):  # nothing is even written
                    await redis.execute("GET", "key0", deadline=trio.current_time())

            async with trio.open_nursery() as nursery:
                for index in range(60):
                    nursery.start_soon(get, index)
                    if index % 6 == 0:
                        nursery.start_soon(abandoned)
                    if index % 6 == 3:
                        nursery.start_soon(too_late)
                await trio.testing.wait_all_tasks_blocked()
                for scope in scopes:
                    scope.cancel()
            assert await redis.execute("PING", deadline=soon()) == b"PONG"
    assert len(scopes) == 10
    assert got == {index: str(index).encode() for index in range(60)}


async def test_a_late_reply_is_dropped_and_the_connection_stays_usable(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            start = trio.current_time()
            with pytest.raises(StateTimeout) as caught:
                # The server answers after 0.5 s; the caller waits 0.1 s.
                await redis.execute("BLPOP", "nothing", 0.5, deadline=start + 0.1)
            assert 0.1 <= trio.current_time() - start < 0.1 + SLACK
            assert caught.value.operation == "BLPOP"
            assert caught.value.timeout == pytest.approx(0.1, abs=0.05)
            # The next command waits behind the late BLPOP's nil, then gets its own.
            assert await redis.execute("PING", deadline=soon()) == b"PONG"
            assert redis.closed_reason is None


@attrs.define
class SilentServer:
    """A TCP listener that accepts and never answers (optionally after a PONG)."""

    pong_first: bool = False
    port: int = 0
    received: list[bytes] = attrs.Factory(list)

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            if self.pong_first:
                self.received.append(await stream.receive_some())
                await stream.send_all(b"+PONG\r\n")
            while data := await stream.receive_some():
                self.received.append(data)  # and never a reply

    @property
    def address(self) -> RedisAddress:
        return RedisAddress(host="127.0.0.1", port=self.port)


async def test_a_server_that_answers_nothing_costs_the_deadline_at_connect() -> None:
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            silent = SilentServer()
            await nursery.start(silent.serve)
            start = trio.current_time()
            with pytest.raises(StateTimeout) as caught:
                await open_redis(silent.address, deadline=start + 0.25)
            assert 0.25 <= trio.current_time() - start < 0.25 + SLACK
            assert caught.value.operation == "connect"
            nursery.cancel_scope.cancel()


async def test_a_server_that_stops_answering_costs_each_call_its_deadline() -> None:
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            silent = SilentServer(pong_first=True)
            await nursery.start(silent.serve)
            async with await open_redis(silent.address, deadline=soon()) as redis:
                for _ in range(3):
                    start = trio.current_time()
                    with pytest.raises(StateTimeout):
                        await redis.execute("EVALSHA", "f" * 40, 0, deadline=start + 0.25)
                    assert 0.25 <= trio.current_time() - start < 0.25 + SLACK
                # Two callers at once: each is bounded by its own deadline.
                start = trio.current_time()
                ends: list[float] = []

                async def call(seconds: float) -> None:
                    with pytest.raises(StateTimeout):
                        await redis.execute("PING", deadline=start + seconds)
                    ends.append(trio.current_time() - start)

                async with trio.open_nursery() as callers:
                    callers.start_soon(call, 0.2)
                    callers.start_soon(call, 0.4)
                assert 0.2 <= ends[0] < 0.4 <= ends[1] < 0.4 + SLACK
            nursery.cancel_scope.cancel()


async def test_connect_refused_is_unavailable() -> None:
    # A port bound but not listening: the connection is refused.
    with socket.socket() as closed, trio.fail_after(LIMIT):
        closed.bind(("127.0.0.1", 0))
        address = RedisAddress(host="127.0.0.1", port=closed.getsockname()[1])
        with pytest.raises(StateUnavailable) as caught:
            await open_redis(address, deadline=soon())
        assert caught.value.operation == "connect"


async def test_a_lost_connection_fails_calls_at_once(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with (
            await open_redis(redis_server.address, deadline=soon(), client_name="victim") as redis,
            await open_redis(redis_server.address, deadline=soon()) as admin,
        ):
            assert await admin.execute("CLIENT", "KILL", "SKIPME", "yes", deadline=soon()) == 1
            start = trio.current_time()
            with pytest.raises(StateUnavailable):
                await redis.execute("PING", deadline=start + 5)
            assert trio.current_time() - start < SLACK
            await redis.wait_closed()
            assert redis.closed_reason is not None
            with pytest.raises(StateUnavailable):
                await redis.execute("PING", deadline=soon())


async def test_a_stopped_server_fails_calls(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            await trio.to_thread.run_sync(redis_server.stop)
            with pytest.raises(StateUnavailable):
                await redis.execute("PING", deadline=soon())
        await trio.to_thread.run_sync(redis_server.start)  # same port, empty
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            assert await redis.execute("PING", deadline=soon()) == b"PONG"


async def test_closing_fails_later_calls(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        redis = await open_redis(redis_server.address, deadline=soon())
        await redis.aclose()
        with pytest.raises(StateUnavailable, match="closed"):
            await redis.execute("PING", deadline=soon())


@pytest.mark.parametrize("login", ["default user", "acl user"])
async def test_auth_and_select(start_redis: Callable[..., RedisServer], login: str) -> None:
    server = start_redis(
        "--requirepass", "s3cret", "--user", "app", "on", ">app-pass", "+@all", "~*"
    )
    if login == "default user":
        good = attrs.evolve(server.address, password="s3cret", db=3)
        bad = attrs.evolve(server.address, password="wrong")
    else:
        good = attrs.evolve(server.address, username="app", password="app-pass", db=3)
        bad = attrs.evolve(server.address, username="app", password="wrong")
    with trio.fail_after(LIMIT):
        async with await open_redis(good, deadline=soon(), client_name="tf-test") as redis:
            await redis.execute("SET", "in-db-3", 1, deadline=soon())
            assert await redis.execute("CLIENT", "GETNAME", deadline=soon()) == b"tf-test"
            assert await redis.execute("SELECT", 0, deadline=soon()) == b"OK"
            assert await redis.execute("EXISTS", "in-db-3", deadline=soon()) == 0
        with pytest.raises(StateReplyError) as caught:
            await open_redis(bad, deadline=soon())
        assert caught.value.code == "WRONGPASS"
        assert caught.value.operation == "AUTH"
        assert "wrong" not in str(caught.value)
        with pytest.raises(StateReplyError) as caught:
            await open_redis(attrs.evolve(server.address, password=None), deadline=soon())
        assert caught.value.code == "NOAUTH"
        with pytest.raises(StateReplyError) as caught:
            await open_redis(attrs.evolve(good, db=99), deadline=soon())
        assert caught.value.operation == "SELECT"


async def test_scripts_run_by_sha_and_load_themselves_when_missing(
    redis_server: RedisServer,
) -> None:
    script = Script("return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}")
    with trio.fail_after(LIMIT):
        async with await open_redis(redis_server.address, deadline=soon()) as redis:
            for expected in (1, 2):
                reply = await redis.run_script(script, ["k"], ["a"], deadline=soon())
                assert reply == [b"k", b"a", expected]
            assert await _calls(redis, "evalsha") == 2
            assert await _calls(redis, "eval") == 1  # the first EVALSHA said NOSCRIPT
            await redis.execute("SCRIPT", "FLUSH", deadline=soon())
            assert await redis.run_script(script, ["k"], ["b"], deadline=soon()) == [b"k", b"b", 3]
            assert await _calls(redis, "eval") == 2
            with pytest.raises(StateReplyError, match="boom"):
                await redis.run_script(
                    Script("return redis.error_reply('boom')"), [], [], deadline=soon()
                )


async def _calls(redis: RedisConnection, command: str) -> int:
    """How often the server ran ``command`` (INFO commandstats)."""
    info = await redis.execute("INFO", "commandstats", deadline=soon())
    assert isinstance(info, bytes)
    for line in info.decode().splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


async def test_subscription_delivers_messages_in_order(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with (
            await open_subscription(
                redis_server.address, ["fleet:freed", "fleet:other"], deadline=soon()
            ) as subscription,
            await open_redis(redis_server.address, deadline=soon()) as redis,
        ):
            # Subscribed once open_subscription returns: nothing is missed.
            assert await redis.execute("PUBLISH", "fleet:freed", "gpu-1", deadline=soon()) == 1
            await redis.execute("PUBLISH", "fleet:other", b"x", deadline=soon())
            await redis.execute("PUBLISH", "elsewhere", b"y", deadline=soon())
            await redis.execute("PUBLISH", "fleet:freed", "gpu-2", deadline=soon())
            got: list[Message] = []
            async for message in subscription:
                got.append(message)
                if len(got) == 3:
                    break
            assert got == [
                Message(b"fleet:freed", b"gpu-1"),
                Message(b"fleet:other", b"x"),
                Message(b"fleet:freed", b"gpu-2"),
            ]
            await subscription.aclose()
            assert [message async for message in subscription] == []


async def test_subscription_raises_when_the_server_goes(redis_server: RedisServer) -> None:
    with trio.fail_after(LIMIT):
        async with await open_subscription(
            redis_server.address, ["c"], deadline=soon()
        ) as subscription:
            await trio.to_thread.run_sync(redis_server.stop)
            with pytest.raises(StateUnavailable):
                async for _ in subscription:
                    pass


async def test_subscription_to_a_silent_server_is_bounded() -> None:
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            silent = SilentServer()
            await nursery.start(silent.serve)
            start = trio.current_time()
            with pytest.raises(StateTimeout):
                await open_subscription(silent.address, ["c"], deadline=start + 0.25)
            assert 0.25 <= trio.current_time() - start < 0.25 + SLACK
            nursery.cancel_scope.cancel()


async def test_rediss_connects_over_tls_and_checks_the_certificate(
    start_redis: Callable[..., RedisServer], tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    tls_port = free_port()
    start_redis(
        *("--tls-port", str(tls_port), "--tls-auth-clients", "no"),
        *(
            "--tls-cert-file",
            str(tmp_path / "cert.pem"),
            "--tls-key-file",
            str(tmp_path / "key.pem"),
        ),
        *("--tls-ca-cert-file", str(tmp_path / "ca.pem")),
    )
    address = parse_redis_url(f"rediss://127.0.0.1:{tls_port}")
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    with trio.fail_after(LIMIT):
        async with await open_redis(address, deadline=soon(), ssl_context=trusted) as redis:
            assert await redis.execute("PING", deadline=soon()) == b"PONG"
        async with await open_subscription(
            address, ["c"], deadline=soon(), ssl_context=trusted
        ) as subscription:
            assert subscription.channels == ("c",)
        # The system's trust store does not know this CA.
        with pytest.raises(StateUnavailable) as caught:
            await open_redis(address, deadline=soon())
        assert caught.value.operation == "connect"
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)


async def test_closing_a_subscription_ends_an_iteration_in_another_task(
    redis_server: RedisServer,
) -> None:
    ended = trio.Event()
    with trio.fail_after(LIMIT):
        subscription = await open_subscription(redis_server.address, ["c"], deadline=soon())

        async def listen() -> None:
            async for _ in subscription:
                pass  # nothing is published
            ended.set()  # StopAsyncIteration, not StateUnavailable

        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            await trio.testing.wait_all_tasks_blocked()
            await subscription.aclose()
        assert ended.is_set()
