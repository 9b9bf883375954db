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
    """Node "a" closes a connection pooled after a chunked answer; the next checkout sees it."""
    stream, node = idle_pair()
    await pool.release("a", stream, exchanged(CHUNKED_HEAD), chunked=True)
    node.close()
    await trio.lowlevel.wait_readable(stream.socket)
    assert await pool.acquire("a") is None  # closed, never used


async def test_checkout_learns_a_close_right_after_a_chunked_answer() -> None:
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    await closed_at_checkout(pool)
    # From now on a's connections close after a chunked answer; others stay.
    after_stream, after_stream_node = idle_pair()
    after_json, after_json_node = idle_pair()
    with after_stream_node, after_json_node:
        await pool.release("a", after_stream, exchanged(CHUNKED_HEAD), chunked=True)
        assert after_stream.socket.fileno() == -1
        await pool.release("a", after_json, exchanged(OK_HEAD))
        assert pool.idle_count("a") == 1
        other, other_node = idle_pair()  # another node is not tarred with a's brush
        with other_node:
            await pool.release("b", other, exchanged(CHUNKED_HEAD), chunked=True)
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
    await pool.release("a", stream, exchanged(CHUNKED_HEAD), chunked=True)
    mock_clock.jump(CLOSED_AFTER_ANSWER + 1)
    node.close()
    await trio.lowlevel.wait_readable(stream.socket)
    assert await pool.acquire("a") is None
    again, again_node = idle_pair()
    with again_node:
        await pool.release("a", again, exchanged(CHUNKED_HEAD), chunked=True)
        assert pool.idle_count("a") == 1
        await pool.aclose()


async def test_a_reload_that_removes_the_node_forgets_it() -> None:
    pool = ConnectionPool(max_idle=4, idle_timeout=60.0)
    await closed_at_checkout(pool)
    await pool.aclose("a")  # a reload removed "a"; a later "a" is another server
    again, again_node = idle_pair()
    with again_node:
        await pool.release("a", again, exchanged(CHUNKED_HEAD), chunked=True)
        assert pool.idle_count("a") == 1
        await pool.aclose()


# -- through the proxy: the node closes as the next request arrives -----------------------


@attrs.define
class ClosesAfterStreams:
    """An HTTP/1.1 node that answers ``/stream`` in chunks, anything else with a length.

    After a chunked answer it says keep-alive but closes the connection: as
    the next request arrives on it, the worst moment (llama-server closes an
    instant after its last chunk; a request taken from the pool in that
    instant meets the close).
    """

    connections: int = 0
    requests: int = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        chunked = False
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data or chunked:
                    break  # after a chunked answer: the next request meets a close
                conn.receive_data(data)
                event = conn.next_event()
                while event is not h11.NEED_DATA:
                    if isinstance(event, h11.Request):
                        self.requests += 1
                        chunked = event.target == b"/stream"
                    elif isinstance(event, h11.EndOfMessage):
                        await stream.send_all(answer(conn, chunked))
                        conn.start_next_cycle()
                    event = conn.next_event()
        except (trio.BrokenResourceError, h11.ProtocolError):
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


async def test_after_the_first_close_streams_go_out_on_new_connections() -> None:
    node = ClosesAfterStreams()
    with trio.fail_after(10):
        async with proxy_to(node, pool_idle_timeout=30.0) as address:
            first = await request_tcp(address, target="/stream", body=b"{}")
            assert first is not None
            assert first.status == 200
            # The pooled connection meets the node's close: the request may
            # have reached it, so it is not sent to that node again (one
            # node: the answer is the proxy's 502). The pool has learnt.
            second = await request_tcp(address, target="/stream", body=b"{}")
            assert second is not None
            assert second.status == 502
            for _ in range(3):
                later = await request_tcp(address, target="/stream", body=b"{}")
                assert later is not None
                assert later.status == 200
                assert later.header("x-failover-attempts") == "1"
            assert node.connections == 4  # the first two shared one; then one each
            for _ in range(2):  # answers with a length are still pooled
                plain = await request_tcp(address, target="/json", body=b"{}")
                assert plain is not None
                assert plain.status == 200
            assert node.connections == 5  # one for both
    # The second request never reached the node's parser: it met the close.
    assert node.requests == 6
