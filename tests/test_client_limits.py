"""Client-side limits: slow heads (408), idle keep-alive, head size (431), body
size (413), and ``--max-connections`` leaving extra clients in the backlog.

Most cases run the whole proxy on in-memory streams under the autojump clock
and speak raw bytes, so that a test can send exactly the malformed or slow
request it means. ``exchange`` is the raw client; the other test modules of
this issue import it from here.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

import attrs
import h11
import pytest
import trio
import trio.testing

from trio_failover.core.config import Config
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import FakeNode, Fleet, healthy, start_in_fleet

OK_BODY = b'{"ok": true}'
GET = b"GET /health HTTP/1.1\r\nHost: proxy.test\r\n\r\n"


# -- a raw-bytes client ----------------------------------------------------------------------


@attrs.frozen
class RawResponse:
    """One response as the raw client parsed it."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    at: float

    def header(self, name: str) -> bytes | None:
        key = name.lower().encode()
        return next((value for n, value in self.headers if n == key), None)

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.frozen
class RawResult:
    """Everything the proxy sent back on one connection, and when it closed it."""

    responses: list[RawResponse]
    informational: list[int]
    closed_at: float
    raw: list[tuple[float, bytes]]

    @property
    def statuses(self) -> list[int]:
        return [response.status for response in self.responses]

    @property
    def only(self) -> RawResponse:
        assert len(self.responses) == 1, self.statuses
        return self.responses[0]


def parse_responses(
    chunks: Sequence[tuple[float, bytes]], methods: Sequence[bytes] = ()
) -> tuple[list[RawResponse], list[int]]:
    """Parse a whole connection's output as HTTP/1.1 responses, strictly.

    Responses are matched to requests in order; ``methods`` names the
    request methods where it matters (a response to HEAD has no body).
    Raises ``h11.RemoteProtocolError`` on anything malformed, including a
    response cut short by the close.
    """
    conn = h11.Connection(h11.CLIENT)
    responses: list[RawResponse] = []
    informational: list[int] = []
    head: h11.Response | None = None
    body = bytearray()
    feed = [*chunks, (chunks[-1][0] if chunks else 0.0, b"")]
    index = 0
    at = 0.0
    while True:
        if conn.our_state is h11.IDLE:
            if not conn.trailing_data[0] and not any(data for _, data in feed[index:]):
                return responses, informational  # a clean close between responses
            method = methods[len(responses)] if len(responses) < len(methods) else b"GET"
            conn.send(h11.Request(method=method, target="/", headers=[("host", "proxy.test")]))
            conn.send(h11.EndOfMessage())
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            if head is None and not body and index == len(feed):
                # Closed before a response began (after a 100 Continue at
                # most): a workload cut short by the client's own FIN.
                return responses, informational
            raise
        if event is h11.NEED_DATA:
            if index == len(feed):
                raise AssertionError("parser wants data after the close")
            at, data = feed[index]
            index += 1
            conn.receive_data(data)
            continue
        if isinstance(event, h11.ConnectionClosed):
            return responses, informational
        if isinstance(event, h11.InformationalResponse):
            informational.append(event.status_code)
        elif isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            responses.append(RawResponse(head.status_code, list(head.headers), bytes(body), at))
            head, body = None, bytearray()
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            else:  # the server said it closes: the rest must be the close itself
                conn.send(h11.ConnectionClosed())


async def exchange(
    proxy: Proxy,
    parts: bytes | Sequence[bytes],
    *,
    pause: float = 0.0,
    first_pause: float = 0.0,
    methods: Sequence[bytes] = (),
    half_close: bool = False,
    parse: bool = True,
) -> RawResult:
    """Send raw bytes to ``proxy`` on a new in-memory connection and read until it closes.

    ``parts`` go out one by one, ``pause`` seconds apart (after waiting
    ``first_pause`` before the first). The client never closes first unless
    ``half_close``: then it sends EOF after the last part. The answer is
    parsed strictly unless ``parse`` is false (``RawResult.raw`` has it all).
    """
    client, server = trio.testing.memory_stream_pair()
    received: list[tuple[float, bytes]] = []
    if isinstance(parts, bytes):
        parts = [parts]

    async def send_parts() -> None:
        await trio.sleep(first_pause)
        try:
            for number, part in enumerate(parts):
                if number and pause:
                    await trio.sleep(pause)
                await client.send_all(part)
            if half_close:
                await client.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the proxy closed first: what it sent is what counts

    await start_in_fleet(proxy)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.handle_connection, server)
            nursery.start_soon(send_parts)
            while True:
                try:
                    data = await client.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    break
                received.append((trio.current_time(), bytes(data)))
            closed_at = trio.current_time()
            nursery.cancel_scope.cancel()
    await client.aclose()
    if not parse:
        return RawResult([], [], closed_at, received)
    responses, informational = parse_responses(received, methods)
    return RawResult(responses, informational, closed_at, received)


def assert_json_error(response: RawResponse, status: int, code: str) -> None:
    """The proxy's own error answer: the status, a JSON body naming ``code``, and a close."""
    assert response.status == status
    assert response.header("content-type") == b"application/json"
    assert response.header("connection") == b"close"
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str)
    assert error["message"]


def make_proxy(fleet: Fleet, **settings: Any) -> Proxy:
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)
    return Proxy(config, connector=fleet.connector)


def post(body: bytes, target: bytes = b"/v1/chat/completions") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: %d\r\n\r\n%s" % (
        target,
        len(body),
        body,
    )


# -- slow heads: 408 -------------------------------------------------------------------------


async def test_head_trickled_byte_by_byte_gets_408_at_the_header_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)  # client_header_timeout = 30 s
        head = b"GET / HTTP/1.1\r\nHost: proxy.test\r\nX-Slow: " + b"z" * 100
        # One byte every 2 s: each byte is "progress", none of it resets the deadline.
        result = await exchange(proxy, [head[:20], *[bytes([b]) for b in head[20:]]], pause=2.0)
        assert result.only.at == 30.0
        assert result.closed_at == 30.0
        assert_json_error(result.only, 408, "request_timeout")
        assert fleet["a"].received == []


async def test_head_deadline_of_a_new_connection_counts_from_the_connect(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, client_header_timeout=10.0)
        # Silent for 8 s, then a trickle: the head is still due 10 s after the connect.
        result = await exchange(proxy, [b"GET / HT", b"T", b"P"], first_pause=8.0, pause=1.0)
        assert result.only.at == 10.0
        assert_json_error(result.only, 408, "request_timeout")


async def test_connection_that_never_sends_is_closed_silently_at_the_header_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, client_header_timeout=12.5)
        result = await exchange(proxy, [])
        assert result.responses == []
        assert result.closed_at == 12.5


async def test_stalled_body_gets_408_one_header_timeout_after_its_last_byte(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, client_header_timeout=5.0)
        head = b"POST / HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 10\r\n\r\n"
        result = await exchange(proxy, [head, b"12", b"34"], pause=4.0)
        assert result.only.at == 8.0 + 5.0
        assert_json_error(result.only, 408, "request_timeout")
        assert fleet["a"].received == []


# -- keep-alive ------------------------------------------------------------------------------


async def test_idle_keepalive_connection_is_closed_after_the_keepalive_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)  # keepalive_timeout = 75 s
        result = await exchange(proxy, GET)
        assert result.statuses == [200]
        assert result.only.at == 0.0
        assert result.only.header("connection") is None  # kept alive...
        assert result.closed_at == 75.0  # ...until it idled for 75 s


async def test_keepalive_timeout_is_the_wait_between_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, keepalive_timeout=20.0)
        # The second request comes 19 s after the first: in time, and it
        # starts a new 20 s idle period once answered.
        result = await exchange(proxy, [GET, GET], pause=19.0)
        assert result.statuses == [200, 200]
        assert [r.at for r in result.responses] == [0.0, 19.0]
        assert result.closed_at == 39.0
        assert len(fleet["a"].received) == 2


async def test_next_head_on_a_keepalive_connection_has_its_own_header_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, client_header_timeout=10.0)
        # Answered at 0; the next head starts at 50 s (keep-alive is 75 s) and trickles.
        result = await exchange(proxy, [GET, b"GET / HTTP/1.1\r\n", b"Host"], pause=50.0)
        assert result.statuses == [200, 408]
        assert result.responses[1].at == 60.0
        assert_json_error(result.responses[1], 408, "request_timeout")


# -- sizes: 431 and 413 ----------------------------------------------------------------------


def head_of_size(size: int) -> bytes:
    """A complete GET head of exactly ``size`` bytes."""
    start = b"GET / HTTP/1.1\r\nHost: proxy.test\r\nX-Pad: "
    end = b"\r\n\r\n"
    return start + b"p" * (size - len(start) - len(end)) + end


@pytest.mark.parametrize("parts", [1, 7])
async def test_head_over_the_limit_gets_431(
    autojump_clock: trio.testing.MockClock, parts: int
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, max_request_head=4096)
        head = head_of_size(4097)
        step = -(-len(head) // parts)
        result = await exchange(proxy, [head[i : i + step] for i in range(0, len(head), step)])
        assert_json_error(result.only, 431, "headers_too_large")
        assert fleet["a"].received == []


async def test_head_at_the_limit_is_served(autojump_clock: trio.testing.MockClock) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, max_request_head=4096)
        result = await exchange(proxy, head_of_size(4096))
        assert result.statuses == [200]


async def test_complete_head_over_the_limit_in_one_write_gets_431(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # With the default 64 KiB limit, a 100 KiB head that arrives whole used to
    # slip through: h11 measures only heads that are still incomplete.
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, head_of_size(100_000))
        assert_json_error(result.only, 431, "headers_too_large")
        assert fleet["a"].received == []


async def test_unending_header_line_gets_431_not_a_hang(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, max_request_head=200_000)  # above the reader's own buffer
        line = b"GET / HTTP/1.1\r\nX-Long: " + b"x" * 250_000
        result = await exchange(proxy, line)
        assert_json_error(result.only, 431, "headers_too_large")
        assert result.closed_at == 0.0


async def test_declared_body_over_the_limit_gets_413_before_it_is_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, max_request_body=1000)
        head = b"POST / HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 1001\r\n\r\n"
        result = await exchange(proxy, head)  # no body bytes at all
        assert_json_error(result.only, 413, "request_too_large")
        assert result.only.at == 0.0
        assert fleet["a"].received == []


async def test_chunked_body_over_the_limit_gets_413(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, max_request_body=1000)
        head = b"POST / HTTP/1.1\r\nHost: proxy.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"1f4\r\n" + b"c" * 500 + b"\r\n"
        result = await exchange(proxy, [head, chunk, chunk, b"1\r\nc\r\n"], pause=1.0)
        assert_json_error(result.only, 413, "request_too_large")
        assert result.only.at == 3.0  # refused on the byte that crossed the limit
        assert fleet["a"].received == []


async def test_body_at_the_limit_is_forwarded(autojump_clock: trio.testing.MockClock) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, max_request_body=1000)
        chunked = (
            b"POST / HTTP/1.1\r\nHost: proxy.test\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"1f4\r\n" + b"c" * 500 + b"\r\n1f4\r\n" + b"c" * 500 + b"\r\n0\r\n\r\n"
        )
        result = await exchange(proxy, [post(b"b" * 1000), chunked])
        assert result.statuses == [200, 200]
        assert [r.body for r in fleet["a"].received] == [b"b" * 1000, b"c" * 1000]


# -- lingering after an error answer --------------------------------------------------------


@pytest.mark.parametrize(
    ("client", "closed_at"),
    [
        ("closes", 0.0),  # a client that read the answer and left: done at once
        ("silent", 1.0),  # one idle timeout without a byte
        ("sends forever", 5.0),  # the linger's hard limit
    ],
)
async def test_connection_lingers_a_bounded_time_after_an_error_answer(
    autojump_clock: trio.testing.MockClock, client: str, closed_at: float
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = await start_in_fleet(make_proxy(fleet, max_request_body=10))
        near, far = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                await proxy.handle_connection(far)
                finished.append(trio.current_time())

            finished: list[float] = []
            nursery.start_soon(serve)
            await near.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99\r\n\r\n")
            answer = b""
            while chunk := await near.receive_some(65536):  # the 413, then the half-close
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 413 ")
            assert trio.current_time() == 0.0
            if client == "closes":
                await near.aclose()
            elif client == "sends forever":
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    for _ in range(100):
                        await near.send_all(b"x" * 1000)
                        await trio.sleep(0.5)
        assert finished == [closed_at]


# -- answers to HEAD -------------------------------------------------------------------------


async def test_error_answer_to_head_has_no_body(autojump_clock: trio.testing.MockClock) -> None:
    # h11 refuses to send a body in answer to HEAD; the proxy's own error
    # answers must leave it out instead of sending nothing at all.
    async with Fleet({"a": FakeNode(refuse=True)}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(
            proxy, b"HEAD /v1/models HTTP/1.1\r\nHost: proxy.test\r\n\r\n", methods=[b"HEAD"]
        )
        assert result.statuses == [502]
        assert result.only.body == b""
        assert result.only.header("content-type") == b"application/json"


# -- --max-connections: extra clients wait in the kernel's backlog ---------------------------


async def _open(address: tuple[str, int]) -> trio.SocketStream:
    return await trio.open_tcp_stream(*address)


async def _read_response(stream: trio.SocketStream) -> bytes:
    data = b""
    while not data.endswith(OK_BODY):
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    return data


async def test_connections_over_max_connections_wait_in_the_backlog() -> None:
    async with Fleet({"a": FakeNode(healthy(OK_BODY))}) as fleet:
        node = await fleet.serve_tcp("a")
        config = Config(
            upstreams=[node], listen="127.0.0.1:0", admin_listen=None, max_connections=2
        )
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(serve, config)
                holders = [await _open(bound.client) for _ in range(2)]
                for holder in holders:  # an answer proves it accepted; kept alive
                    await holder.send_all(GET)
                    assert (await _read_response(holder)).endswith(OK_BODY)
                # Both accepted and held open: the limit is reached.
                waiting = await _open(bound.client)  # the kernel completes the handshake
                await waiting.send_all(GET)
                with trio.move_on_after(0.5) as idle:
                    await waiting.receive_some(65536)
                assert idle.cancelled_caught, "a connection over the limit was served or dropped"
                await holders[0].aclose()  # a slot frees: the waiting client is accepted
                data = await _read_response(waiting)
                assert data.startswith(b"HTTP/1.1 200 ")
                assert data.endswith(OK_BODY)
                for stream in [holders[1], waiting]:
                    await stream.aclose()
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_413_reaches_a_client_that_sends_its_whole_body_before_reading(
    framing: str,
) -> None:
    # The proxy answers 413 early (at the Content-Length, or at the chunk
    # that crosses the limit) while the client, like Python's http.client,
    # sends its whole body before it reads. Closing with those bytes unread
    # would make the kernel reset the connection: the client would see a
    # broken pipe, not the 413.
    async with Fleet({"a": FakeNode()}) as fleet:
        node = await fleet.serve_tcp("a")
        config = Config(
            upstreams=[node], listen="127.0.0.1:0", admin_listen=None, max_request_body=1024
        )
        size = 8 * 1024 * 1024
        if framing == "chunked":
            head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            piece = b"10000\r\n" + b"x" * 65536 + b"\r\n"
            tail = b"0\r\n\r\n"
        else:
            head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
            piece, tail = b"x" * 65536, b""
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                bound: BoundAddresses = await nursery.start(serve, config)
                stream = await trio.open_tcp_stream(*bound.client)
                await stream.send_all(head)
                for _ in range(size // 65536):
                    await stream.send_all(piece)
                await stream.send_all(tail)
                data = b""
                while chunk := await stream.receive_some(65536):
                    data += chunk
                assert data.startswith(b"HTTP/1.1 413 "), data[:200]
                assert data.endswith(b'"code": "request_too_large"}}')
                await stream.aclose()
                nursery.cancel_scope.cancel()
