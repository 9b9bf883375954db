"""A node that closes its connections right after one kind of answer, though it
said keep-alive (llama-server after each streamed answer): the pool learns it
from the first such close it sees, and pools no such connection again.

The rule (``closed_after_answer``) is a table; the three places the pool
sees a close (checkout, the watcher, an attempt whose request the node
answered with a close) run over real 127.0.0.1 sockets; the wiring runs the
whole proxy in front of a real-socket node that closes as the next request
comes, the race that made a waiting request fail over in the field.
"""

from __future__ import annotations

import attrs
import h11
import pytest
import trio
import trio.testing
from test_pool import OK_HEAD, exchanged, idle_pair, proxy_to

from trio_failover.testing import request_tcp
from trio_failover.wire.pool import (
    CLOSED_AFTER_ANSWER,
    WATCH_DELAY,
    ConnectionPool,
    closed_after_answer,
    reusable_now,
    take_idle,
)

CHUNKED_HEAD = h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")])


@pytest.mark.parametrize(
    ("idle_for", "learnt"),
    [
        (0.0, True),  # closed with the answer's last chunk
        (0.3, True),
        (CLOSED_AFTER_ANSWER - 0.001, True),
        (CLOSED_AFTER_ANSWER, False),  # an idle timeout, not the answer's doing
        (5.0, False),  # uvicorn's keep-alive timeout
    ],
)
def test_a_close_soon_after_the_answer_is_the_answer_s_doing(idle_for: float, learnt: bool) -> None:
    assert closed_after_answer(idle_for) is learnt


async def closed_at_checkout(pool: ConnectionPool) -> None:
    """Node "a" closes a connection pooled after an answer with a length; the next
    checkout (at once: such connections are reused at once) sees it."""
    stream, node = idle_pair()
    await pool.release("a", stream, exchanged(OK_HEAD))
    node.close()
    await trio.lowlevel.wait_readable(stream.socket)
    assert await pool.acquire("a") is None  # closed, never used


async def test_checkout_learns_a_close_right_after_an_answer() -> None:
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    await closed_at_checkout(pool)
    # From now on a's connections close after an answer with a length;
    # those of streamed answers are pooled still.
    after_json, after_json_node = idle_pair()
    after_stream, after_stream_node = idle_pair()
    with after_stream_node, after_json_node:
        await pool.release("a", after_json, exchanged(OK_HEAD))
        assert after_json.socket.fileno() == -1
        await pool.release("a", after_stream, exchanged(CHUNKED_HEAD), chunked=True)
        assert pool.idle_count("a") == 1
        other, other_node = idle_pair()  # another node is not tarred with a's brush
        with other_node:
            await pool.release("b", other, exchanged(OK_HEAD))
            assert pool.idle_count("b") == 1
        await pool.aclose()


async def test_the_watcher_learns_it_too(mock_clock: trio.testing.MockClock) -> None:
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    stream, node = idle_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.watch)
        await pool.release("a", stream, exchanged(CHUNKED_HEAD), chunked=True)
        node.close()
        await trio.lowlevel.wait_readable(stream.socket)
        mock_clock.jump(WATCH_DELAY)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.idle_count("a") == 0
        again, again_node = idle_pair()
        with again_node:
            await pool.release("a", again, exchanged(CHUNKED_HEAD), chunked=True)
            assert again.socket.fileno() == -1  # not pooled
        nursery.cancel_scope.cancel()


async def test_a_close_long_after_the_answer_teaches_nothing(
    mock_clock: trio.testing.MockClock,
) -> None:
    # A node whose keep-alive timeout is shorter than the pool's: its idle
    # close is no sign that it closes after every answer.
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    stream, node = idle_pair()
    await pool.release("a", stream, exchanged(OK_HEAD))
    mock_clock.jump(CLOSED_AFTER_ANSWER + 1)
    node.close()
    await trio.lowlevel.wait_readable(stream.socket)
    assert await pool.acquire("a") is None
    again, again_node = idle_pair()
    with again_node:
        await pool.release("a", again, exchanged(OK_HEAD))
        assert pool.idle_count("a") == 1
        await pool.aclose()


async def test_a_reload_that_removes_the_node_forgets_it() -> None:
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    await closed_at_checkout(pool)
    await pool.aclose("a")  # a reload removed "a"; a later "a" is another server
    again, again_node = idle_pair()
    with again_node:
        await pool.release("a", again, exchanged(OK_HEAD))
        assert pool.idle_count("a") == 1
        await pool.aclose()


# -- through the proxy: a node that closes after its streams, at the worst moment -------


@attrs.define
class ClosesAfterStreams:
    """An HTTP/1.1 node that answers ``/stream`` in chunks, anything else with a length.

    After a chunked answer it says keep-alive but closes the connection, as
    llama-server does an instant after its last chunk; here at the worst
    moment for the proxy: only when the next request arrives, on that
    connection (read and dropped, as llama-server's HTTP library drains
    what comes before it closes) or on another one.
    """

    closes_after: frozenset[bytes] = frozenset({b"/stream"})  # the targets it closes after
    connections: int = 0
    requests: int = 0
    dropped: int = 0  # requests that met a close
    _streamed: list[trio.SocketStream] = attrs.Factory(list)  # idle after a stream

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                if stream in self._streamed:  # the next request: drained, then the close
                    self.dropped += 1
                    break
                for other in self._streamed:  # a request elsewhere: now the close
                    await trio.aclose_forcefully(other)
                self._streamed.clear()
                conn.receive_data(data)
                event = conn.next_event()
                while event is not h11.NEED_DATA:
                    if isinstance(event, h11.Request):
                        self.requests += 1
                        target = event.target
                        chunked = target == b"/stream"
                    elif isinstance(event, h11.EndOfMessage):
                        await stream.send_all(answer(conn, chunked))
                        conn.start_next_cycle()
                        if target in self.closes_after:
                            self._streamed.append(stream)
                    event = conn.next_event()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass
        finally:
            await trio.aclose_forcefully(stream)


def answer(conn: h11.Connection, chunked: bool) -> bytes:
    framing = ("transfer-encoding", "chunked") if chunked else ("content-length", "2")
    head = h11.Response(status_code=200, headers=[framing, ("keep-alive", "timeout=5")])
    return (
        (conn.send(head) or b"")
        + (conn.send(h11.Data(data=b"ok")) or b"")
        + (conn.send(h11.EndOfMessage()) or b"")
    )


async def test_a_stream_s_connection_is_not_reused_at_once_by_a_node_not_seen_keeping_one() -> None:
    node = ClosesAfterStreams()
    with trio.fail_after(10):
        async with proxy_to(node, pool_idle_timeout=30.0) as address:
            # Back to back, as a queued request takes the slot a stream
            # frees: each goes out on a new connection, none meets a close.
            for _ in range(4):
                streamed = await request_tcp(address, target="/stream", body=b"{}")
                assert streamed is not None
                assert streamed.status == 200
                assert streamed.header("x-failover-attempts") == "1"
            assert node.connections == 4
            for _ in range(2):  # answers with a length are pooled as before
                plain = await request_tcp(address, target="/json", body=b"{}")
                assert plain is not None
                assert plain.status == 200
            assert node.connections == 5
    assert (node.requests, node.dropped) == (6, 0)


# -- a stream's connection, before and after its node was seen keeping one --------------


@pytest.mark.parametrize(
    ("chunked", "idle_for", "kept_before", "reusable"),
    [
        (False, 0.0, False, True),  # an answer with a length: at once, as always
        (True, 0.0, True, True),  # the node kept one before
        (True, 0.0, False, False),  # it may be closing it now
        (True, CLOSED_AFTER_ANSWER - 0.001, False, False),
        (True, CLOSED_AFTER_ANSWER, False, True),  # it lived through the second
    ],
)
def test_reusable_now(chunked: bool, idle_for: float, kept_before: bool, reusable: bool) -> None:
    assert reusable_now(chunked, idle_for, kept_before) is reusable


@attrs.define
class Idle:
    name: str
    idle_since: float
    chunked: bool = False


@pytest.mark.parametrize(
    ("entries", "kept", "taken", "left"),
    [
        # name, idle since, chunked; taken at now=10 with a 4 s idle timeout
        ([("a", 9.0, False), ("b", 9.9, True)], True, "b", ["a"]),  # the newest
        ([("a", 9.0, False), ("b", 9.9, True)], False, "a", ["b"]),  # "b" waits
        ([("a", 8.5, True), ("b", 9.9, True)], False, "a", ["b"]),  # "a" lived 1.5 s
        ([("a", 9.5, True), ("b", 9.9, True)], False, None, ["a", "b"]),
        ([("a", 5.0, False), ("b", 9.9, True)], False, None, ["b"]),  # "a" expired
    ],
)
def test_take_idle_leaves_a_young_stream_connection_of_an_untried_node(
    entries: list[tuple[str, float, bool]], kept: bool, taken: str | None, left: list[str]
) -> None:
    idle = [Idle(name, since, chunked) for name, since, chunked in entries]
    entry, _ = take_idle(idle, now=10.0, idle_timeout=4.0, streams_kept=kept)
    assert (entry.name if entry else None) == taken
    assert [remaining.name for remaining in idle] == left


async def test_a_stream_s_connection_alive_a_second_later_earns_its_node_reuse_at_once(
    mock_clock: trio.testing.MockClock,
) -> None:
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    first, first_node = idle_pair()
    second, second_node = idle_pair()
    with first_node, second_node:
        await pool.release("a", first, exchanged(CHUNKED_HEAD), chunked=True)
        assert await pool.acquire("a") is None  # too young: a new connection instead
        mock_clock.jump(CLOSED_AFTER_ANSWER)
        await pool.release("a", second, exchanged(CHUNKED_HEAD), chunked=True)
        entry = await pool.acquire("a")  # the older one, now a second old
        assert entry is not None
        assert entry.stream is first
        entry = await pool.acquire("a")  # a kept it alive: the young one goes at once
        assert entry is not None
        assert entry.stream is second
    await first.aclose()
    await second.aclose()


async def test_a_request_that_met_the_close_teaches_the_pool() -> None:
    # After answers with a length, which are reused at once: the request
    # on the pooled connection meets the close. It may have reached the
    # node, so it is not sent there again (one node: the proxy's 502);
    # from then on such connections are not pooled.
    node = ClosesAfterStreams(closes_after=frozenset({b"/json"}))
    with trio.fail_after(10):
        async with proxy_to(node, pool_idle_timeout=30.0) as address:
            statuses = []
            for _ in range(4):
                plain = await request_tcp(address, target="/json", body=b"{}")
                assert plain is not None
                statuses.append(plain.status)
            assert statuses == [200, 502, 200, 200]
    assert (node.connections, node.dropped) == (3, 1)
