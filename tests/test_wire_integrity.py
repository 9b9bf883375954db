"""Never hand one client another's bytes (issue 28), over real 127.0.0.1 sockets.

Each case runs the whole proxy (``serve``) in front of a raw node that
records every byte it receives and answers from a script of raw bytes, and
speaks raw bytes to the proxy as a client: the bytes of the issue, exactly.

1. A pooled connection with bytes after a complete answer is closed, never
   used: the next client gets its own answer (plain TCP and TLS).
2. A node answer with both ``Content-Length`` and ``Transfer-Encoding`` is
   relayed by its chunks, without the length.
3. A chunked request body is screened like a head: ``400`` and nothing
   reaches the node.
4. Control bytes in request header values are a ``400``; in a node's reason
   phrase or header value a protocol error (the next node answers).
5. Header names with ``_`` never reach a node.
6. Error answers never quote the peer's bytes.

Then a differential table: hostile requests through the proxy, and for
each the node received nothing (the client got a 4xx) or exactly one
well-framed request.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import re
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import h11
import pytest
import trio
import trustme
from conftest import LogRecords
from hypothesis import given, settings
from hypothesis import strategies as st
from test_client_limits import RawResponse

from trio_failover.core.config import Config, Upstream
from trio_failover.core.errors import ClientError
from trio_failover.core.screen import ChunkScreen, answer_flaw, screen_head
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.wire.upstream import without_peer_bytes

LIMIT = 20  # seconds: every test's bound on the real clock
HOST = b"Host: proxy.test\r\n"


# -- a raw node that records what it receives -------------------------------------------------

# (connection index, request index on it, the request) -> what to send, each
# part after a pause of so many seconds.
Script = Callable[[int, int, h11.Request], Sequence[tuple[float, bytes]]]


def answer(path: bytes) -> bytes:
    """The node's answer to ``path``: 16 bytes of body that name it."""
    body = (b"answer to " + path).ljust(16)[:16]
    return b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n" + body


def answers_by_path(index: int, number: int, request: h11.Request) -> Sequence[tuple[float, bytes]]:
    return [(0.0, answer(request.target))]


def always(raw: bytes) -> Script:
    return lambda index, number, request: [(0.0, raw)]


class RawNode:
    """An HTTP/1.1 node on a real socket: records every byte, answers from ``script``.

    h11 only tells where each request ends (so that the script runs once
    per request); what the node sends is the script's bytes, unchecked.
    After anything h11 rejects the node keeps recording until the close.
    """

    def __init__(
        self,
        script: Script = answers_by_path,
        context: ssl.SSLContext | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.script = script
        self.context = context  # TLS, with the CA of ``ca_file`` for the proxy
        self.ca_file = ca_file
        self.connections: list[bytearray] = []
        self.closed = 0
        self.sent = 0  # script parts sent, in all
        self._news = trio.Event()

    def _tell(self) -> None:
        self._news.set()
        self._news = trio.Event()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds; it is checked at each send and close."""
        while not condition():  # each wake is a send or a close: bounded by the test's limit
            await self._news.wait()

    @property
    def received(self) -> bytes:
        return b"".join(self.connections)

    async def handle(self, raw: trio.SocketStream) -> None:
        stream: trio.abc.Stream = raw
        if self.context is not None:
            stream = trio.SSLStream(raw, self.context, server_side=True)
        index = len(self.connections)
        buffer = bytearray()
        self.connections.append(buffer)
        conn = h11.Connection(h11.SERVER)
        number = 0
        request: h11.Request | None = None
        try:
            while data := await stream.receive_some(65536):
                buffer += data
                if conn.their_state is h11.ERROR:
                    continue
                try:
                    conn.receive_data(data)
                    while (event := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                        if isinstance(event, h11.Request):
                            request = event
                        elif isinstance(event, h11.EndOfMessage):
                            assert request is not None
                            for pause, part in self.script(index, number, request):
                                await trio.sleep(pause)
                                await stream.send_all(part)
                                self.sent += 1
                                self._tell()
                            number += 1
                            # h11 wants our side done before the next request:
                            # play an answer to it (the script's went out raw).
                            conn.send(h11.Response(status_code=204, headers=[]))
                            conn.send(h11.EndOfMessage())
                            conn.start_next_cycle()
                        elif isinstance(event, h11.ConnectionClosed):
                            break
                except h11.ProtocolError:
                    pass  # recorded; h11 is in ERROR now
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)
            self.closed += 1
            self._tell()


@attrs.frozen
class Running:
    proxy: Proxy
    node: RawNode
    address: BoundAddresses


async def listen(nursery: trio.Nursery, handler: Callable[[trio.SocketStream], object]) -> int:
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


@asynccontextmanager
async def running(
    *nodes: RawNode, names: Sequence[str] = ("node", "next"), **settings: object
) -> AsyncIterator[Running]:
    """The proxy (``serve``, pool watcher and all) in front of ``nodes``, in order."""
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            upstreams = []
            for name, node in zip(names, nodes, strict=False):
                port = await listen(nursery, node.handle)
                if node.ca_file is None:
                    upstreams.append(Upstream(name, f"http://127.0.0.1:{port}"))
                else:
                    url = f"https://127.0.0.1:{port}"
                    upstreams.append(Upstream(name, url, ca_file=node.ca_file))
            settings.setdefault("admin_listen", None)
            config = Config(
                upstreams=upstreams,
                listen="127.0.0.1:0",
                discovery_interval=0,  # the nodes record every byte: no checks
                **settings,  # type: ignore[arg-type]
            )
            proxy = Proxy(config)
            address = await nursery.start(functools.partial(serve, config, proxy=proxy))
            yield Running(proxy, nodes[0], address)
            nursery.cancel_scope.cancel()


async def ask(
    address: tuple[str, int], raw: bytes, *, answers: int = 1
) -> tuple[list[RawResponse], bool]:
    """Send ``raw`` on a new connection; read up to ``answers`` responses or the close.

    Returns the responses and whether the proxy closed the connection.
    """
    stream = await trio.open_tcp_stream(*address)
    try:
        await stream.send_all(raw)
        conn = h11.Connection(h11.CLIENT)
        responses: list[RawResponse] = []
        head: h11.Response | None = None
        body = bytearray()
        closed = False
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "proxy.test")]))
        conn.send(h11.EndOfMessage())
        while len(responses) < answers:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                at = trio.current_time()
                responses.append(RawResponse(head.status_code, list(head.headers), bytes(body), at))
                head, body = None, bytearray()
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    closed = True
                    break
                conn.start_next_cycle()
                conn.send(h11.Request(method="GET", target="/", headers=[("host", "proxy.test")]))
                conn.send(h11.EndOfMessage())
            elif isinstance(event, h11.ConnectionClosed):
                closed = True
                break
        if closed or (responses and responses[-1].header("connection") == b"close"):
            try:
                closed = await stream.receive_some(65536) == b""
            except trio.BrokenResourceError:
                closed = True
        return responses, closed
    finally:
        await trio.aclose_forcefully(stream)


def get(path: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\n" + HOST + b"\r\n"


def stray_count(proxy: Proxy, node: str = "node") -> float | None:
    return proxy.metrics.registry.get_sample_value(
        "trio_failover_stray_bytes_total", {"node": node}
    )


# -- 1. stray bytes after a complete answer ----------------------------------------------------

POISON = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nPOISON-D"


def poisons_first_connection(late: float) -> Script:
    """Answers every request; on the first, ``late`` seconds after its answer, the poison."""

    def script(index: int, number: int, request: h11.Request) -> Sequence[tuple[float, bytes]]:
        if index == 0 and number == 0:
            return [(0.0, answer(request.target)), (late, POISON)]
        return [(0.0, answer(request.target))]

    return script


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_node(script: Script, ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> RawNode:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(path)
    return RawNode(script, context, str(path))


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("late", [0.0, 0.03])
@pytest.mark.parametrize("after", [0.05, 0.2, 0.4])
async def test_stray_bytes_on_a_pooled_connection_never_reach_the_next_client(
    tls: bool,
    late: float,
    after: float,
    logged: LogRecords,
    ca: trustme.CA,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The issue's case: GET /a answered whole, then POISON-D on the same
    # connection; client B asks GET /b 0.05 to 0.2 s later (0.4 s: after the
    # watcher's look). On main, B got POISON-D.
    script = poisons_first_connection(late)
    node = tls_node(script, ca, tmp_path_factory) if tls else RawNode(script)
    async with running(node) as run:
        [first], _ = await ask(run.address.client, get(b"/a"))
        assert first.body == b"answer to /a    "
        answered = trio.current_time()
        await node.wait_for(lambda: node.sent == 2)  # the poison went out
        await trio.sleep(max(0.0, answered + after - trio.current_time()))
        [second], _ = await ask(run.address.client, get(b"/b"))
        assert (second.status, second.body) == (200, b"answer to /b    ")
        assert second.header("x-failover-attempts") == b"1"
        await node.wait_for(lambda: node.closed >= 1)  # the poisoned connection closed
        assert stray_count(run.proxy) == 1
    assert len(node.connections) == 2  # /b went out on a fresh connection
    warnings = [
        r for r in logged.records if r.getMessage() == "stray bytes after a complete answer"
    ]
    assert [r.fields for r in warnings] == [{"node": "node"}]  # type: ignore[attr-defined]
    assert not any("POISON" in str(getattr(r, "fields", "")) for r in logged.records)


async def test_an_idle_connection_that_gets_bytes_is_closed_by_the_watcher() -> None:
    # Watched (after WATCH_DELAY), the connection closes as the bytes come,
    # with no checkout needed.
    node = RawNode(poisons_first_connection(0.5))
    async with running(node) as run:
        await ask(run.address.client, get(b"/a"))
        await node.wait_for(lambda: node.sent == 2)
        await node.wait_for(lambda: node.closed == 1)
        assert stray_count(run.proxy) == 1
        assert run.proxy.pool.idle_count("node") == 0


# -- 2. both framings in a node's answer -------------------------------------------------------

BOTH_FRAMINGS = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\n"
)


async def test_an_answer_with_both_framings_is_relayed_by_its_chunks(logged: LogRecords) -> None:
    # On main the node's Content-Length: 16 went to the client with a
    # 5-byte body: h11 refused the write, an internal error, no answer.
    async with running(RawNode(always(BOTH_FRAMINGS))) as run:
        responses, closed = await ask(run.address.client, get(b"/a") + get(b"/b"), answers=2)
    assert [(r.status, r.body) for r in responses] == [(200, b"hello")] * 2
    for response in responses:
        assert response.header("content-length") is None
        assert response.header("transfer-encoding") == b"chunked"
    assert not closed
    assert logged.at(logging.ERROR) == []


async def test_an_answer_that_cannot_be_framed_fails_over_before_commit() -> None:
    both = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: gzip\r\n\r\nok"
    async with running(RawNode(always(both)), RawNode()) as run:
        [response], _ = await ask(run.address.client, get(b"/a"))
        attempts = run.proxy.recent[-1]["attempts"]
    assert (response.status, response.body) == (200, b"answer to /a    ")
    assert [a["outcome"] for a in attempts] == ["protocol_error", "completed"]  # type: ignore[index, union-attr]


# -- 3. chunked request bodies -----------------------------------------------------------------

CHUNKED = b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n"
SMUGGLED = b"GET /SMUGGLED HTTP/1.1\r\n" + HOST + b"\r\n"
BAD_BODIES = {
    "trailer ending in a bare lf": b"0\r\nX-T: y\n\n" + SMUGGLED,
    "last chunk then a bare lf": b"0\r\n\n" + SMUGGLED,
    "bare cr in an extension": b"3;a\rb\r\nabc\r\n0\r\n\r\n",
    "trailing spaces after a size": b"3  \r\nabc\r\n0\r\n\r\n",
    "trailing tab after a size": b"3\t\r\nabc\r\n0\r\n\r\n",
    "control byte in an extension": b"3;a\x01\r\nabc\r\n0\r\n\r\n",
    "obs-fold in a trailer": b"0\r\nX-T: y\r\n z\r\n\r\n",
    "bare cr ending a trailer": b"0\r\nX-T: y\r\r\n\r\n",
}


@pytest.mark.parametrize("body", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
async def test_a_malformed_chunked_body_gets_400_and_reaches_no_node(body: bytes) -> None:
    node = RawNode()
    async with running(node) as run:
        [response], closed = await ask(run.address.client, CHUNKED + body + get(b"/after"))
    assert response.status == 400
    assert json.loads(response.body)["error"]["code"] == "bad_request"
    assert closed
    assert node.received == b""  # on main: GET /SMUGGLED reached the node


async def test_chunk_extensions_count_toward_the_body_limit() -> None:
    chunk = b"1;" + b"e" * 600 + b"\r\na\r\n"
    node = RawNode()
    async with running(node, max_request_body=1024) as run:
        [response], closed = await ask(run.address.client, CHUNKED + chunk * 2 + b"0\r\n\r\n")
    assert response.status == 413
    assert json.loads(response.body)["error"]["code"] == "request_too_large"
    assert closed
    assert node.received == b""


async def test_a_well_formed_chunked_body_with_extensions_and_trailers_goes_through() -> None:
    body = b"3;name=value\r\nabc\r\n2\r\nde\r\n0\r\nX-Checksum: 1\r\n\r\n"
    node = RawNode()
    async with running(node) as run:
        responses, _ = await ask(run.address.client, CHUNKED + body + get(b"/next"), answers=2)
    assert [r.status for r in responses] == [200, 200]
    [one, two] = requests_in(node.received)
    assert one.body == b"abcde"
    assert (b"content-length", b"5") in one.headers
    assert two.target == b"/next"


# -- 4. control bytes in field values ----------------------------------------------------------


@pytest.mark.parametrize("byte", [b"\x01", b"\x1b", b"\x7f"], ids=["soh", "esc", "del"])
async def test_a_control_byte_in_a_request_header_value_gets_400(byte: bytes) -> None:
    node = RawNode()
    async with running(node) as run:
        raw = b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one" + byte + b"two\r\n\r\n"
        [response], closed = await ask(run.address.client, raw)
    assert response.status == 400
    assert closed
    assert node.received == b""


CONTROL_ANSWERS = {
    "reason phrase": b"HTTP/1.1 200 O\x01K\r\nContent-Length: 2\r\n\r\nok",
    "header value, esc": b"HTTP/1.1 200 OK\r\nX-A: a\x1bb\r\nContent-Length: 2\r\n\r\nok",
    "header value, del": b"HTTP/1.1 200 OK\r\nX-A: \x7f\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("raw", list(CONTROL_ANSWERS.values()), ids=list(CONTROL_ANSWERS))
async def test_a_control_byte_in_a_node_answer_is_a_protocol_error(raw: bytes) -> None:
    async with running(RawNode(always(raw)), RawNode()) as run:
        [response], _ = await ask(run.address.client, get(b"/a"))
        attempts = run.proxy.recent[-1]["attempts"]
        assert run.proxy.cooldowns.get("node", trio.current_time()) is None
    assert (response.status, response.body) == (200, b"answer to /a    ")
    assert response.header("x-failover-node") == b"next"
    assert [a["outcome"] for a in attempts] == ["protocol_error", "completed"]  # type: ignore[index, union-attr]


# -- 5. header names with an underscore --------------------------------------------------------


async def test_header_names_with_an_underscore_never_reach_a_node(logged: LogRecords) -> None:
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST + b"Content-Length: 2\r\n"
        b"Transfer_Encoding: chunked\r\nContent_Length: 5\r\nX_Api_Key: secret-key\r\n"
        b"X-Kept: yes\r\n\r\n{}"
    )
    node = RawNode()
    async with running(node) as run:
        [response], _ = await ask(run.address.client, raw)
    assert response.status == 200
    [request] = requests_in(node.received)
    names = [name for name, _ in request.headers]
    assert b"x-kept" in names
    assert not [name for name in names if b"_" in name]
    assert b"secret-key" not in node.received
    dropped = [
        r.fields["header"]  # type: ignore[attr-defined]
        for r in logged.at(logging.DEBUG)
        if r.getMessage() == "request header with an underscore dropped"
    ]
    assert dropped == ["transfer_encoding", "content_length", "x_api_key"]


# -- 6. error answers without the peer's bytes -------------------------------------------------


async def test_a_502_does_not_quote_the_node_bytes() -> None:
    # The node answers with the poison of item 1 as its status line: on
    # main the attempts list said "illegal status line: bytearray(b'POISON-...')".
    raw = b"POISON-D secret of another client\r\n\r\n"
    async with running(RawNode(always(raw))) as run:
        [response], _ = await ask(run.address.client, get(b"/a"))
        status = run.proxy.stats["node"]
    assert response.status == 502
    document = response.json()
    assert document["attempts"][0]["outcome"] == "protocol_error"
    for text in (response.body, json.dumps(str(status)).encode()):
        assert b"POISON" not in text
        assert b"bytearray" not in text


async def test_the_admin_400_does_not_echo_the_bad_line() -> None:
    async with running(RawNode(), admin_listen="127.0.0.1:0") as run:
        assert run.address.admin is not None
        raw = b"GET /status HTTP/1.1\r\nHost: a\r\nthe-secret-line no colon\r\n\r\n"
        [response], _ = await ask(run.address.admin, raw)
    assert response.status == 400
    assert b"secret" not in response.body
    assert response.json()["error"]["message"] == "malformed request"


# -- the differential table --------------------------------------------------------------------

POST = b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST
HOSTILE = {
    # refused: the node must receive nothing
    "cl.te": POST + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX",
    "te.cl": POST
    + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
    "te with a space before the colon": POST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "te xchunked": POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "te chunked, identity": POST + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "te twice": POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n0\r\n\r\n",
    "te folded": POST + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
    "te in http/1.0": b"POST / HTTP/1.0\r\n"
    + HOST
    + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "differing lengths": POST + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "length list": POST + b"Content-Length: 1, 2\r\n\r\nab",
    "bare lf in the head": POST + b"X-A: 1\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bare cr in the head": POST + b"X-A: 1\rContent-Length: 0\r\n\r\n",
    "nul in a value": POST + b"X-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "esc in a value": POST + b"X-A: \x1b[31m\r\nContent-Length: 0\r\n\r\n",
    "bare lf trailer smuggle": CHUNKED + b"0\r\nX-T: y\n\n" + SMUGGLED,
    "last chunk and a bare lf": CHUNKED + b"0\r\n\n" + SMUGGLED,
    "bare lf after a size": CHUNKED + b"3\nabc\r\n0\r\n\r\n",
    "chunk longer than its size": CHUNKED + b"3\r\nabcdef\r\n0\r\n\r\n" + SMUGGLED,
    "size with 0x": CHUNKED + b"0x3\r\nabc\r\n0\r\n\r\n",
    "spaces after a size": CHUNKED + b"3 \r\nabc\r\n0\r\n\r\n",
    "bare cr in an extension": CHUNKED + b"3;x\ry\r\nabc\r\n0\r\n\r\n",
    "no host": b"GET / HTTP/1.1\r\nX-A: 1\r\n\r\n",
    "two hosts": b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    # normalized: the node must receive exactly one well-framed request
    "underscored framing names": POST
    + b"Transfer_Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}",
    "h2c upgrade": b"GET / HTTP/1.1\r\n" + HOST + b"Connection: Upgrade, HTTP2-Settings\r\n"
    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
    "identical lengths": POST + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    "chunked with an extension": CHUNKED + b"2;a=b\r\n{}\r\n0\r\n\r\n",
    "chunked with a trailer": CHUNKED + b"2\r\n{}\r\n0\r\nX-T: y\r\n\r\n",
    "hop-by-hop te": POST + b"TE: trailers\r\nConnection: TE, X-Hop\r\nX-Hop: 1\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    "tab in a value": POST + b"X-A: a\tb\r\nContent-Length: 2\r\n\r\n{}",
    "obs-text in a value": POST + b"X-A: caf\xe9\r\nContent-Length: 2\r\n\r\n{}",
}
FORWARDED = {
    "underscored framing names",
    "h2c upgrade",
    "identical lengths",
    "chunked with an extension",
    "chunked with a trailer",
    "hop-by-hop te",
    "tab in a value",
    "obs-text in a value",
}


def requests_in(raw: bytes) -> list[ReceivedRequest]:
    """The requests in a node's received bytes, parsed strictly; every byte accounted for.

    Strictly: each head line ends in CRLF, no control byte but HTAB, one
    framing, a body framed by ``Content-Length``; nothing left over.
    """
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    found: list[ReceivedRequest] = []
    while conn.trailing_data[0]:
        rest = conn.trailing_data[0]
        end = rest.index(b"\r\n\r\n") + 4
        head = rest[:end]
        assert head.count(b"\n") == head.count(b"\r\n") == head.count(b"\r")
        assert not re.search(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", head)
        request = conn.next_event()
        assert isinstance(request, h11.Request)
        names = [name for name, _ in request.headers]
        assert b"transfer-encoding" not in names  # the proxy frames by length
        assert not [name for name in names if b"_" in name]
        body = b""
        while not isinstance(event := conn.next_event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data), event
            body += event.data
        found.append(ReceivedRequest(request.target, list(request.headers), body))
        conn.send(h11.Response(status_code=204, headers=[]))
        conn.send(h11.EndOfMessage())
        conn.start_next_cycle()
    return found


@attrs.frozen
class ReceivedRequest:
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


async def test_hostile_requests_reach_the_node_as_nothing_or_one_well_framed_request() -> None:
    node = RawNode()
    outcomes: dict[str, str] = {}
    async with running(node, pool_max_idle=0) as run:  # a connection per forwarded request
        for name, raw in HOSTILE.items():
            before = len(node.connections)
            responses, closed = await ask(run.address.client, raw + get(b"/after"), answers=2)
            await node.wait_for(lambda before=before: node.closed == len(node.connections))
            received = b"".join(node.connections[before:])
            statuses = [response.status for response in responses]
            if not received:
                assert statuses, name
                assert 400 <= statuses[-1] < 500, (name, statuses)
                assert closed, name
                outcomes[name] = "refused"
                continue
            forwarded = requests_in(received)
            # The request itself, then the pipelined /after on its own connection.
            assert [r.target for r in forwarded][-1:] == [b"/after"], name
            assert len(forwarded) == 2, (name, forwarded)
            assert len(node.connections) - before == 2, name
            assert statuses == [200, 200], (name, statuses)
            names = {header for header, _ in forwarded[0].headers}
            assert not names & {b"upgrade", b"http2-settings", b"connection", b"te", b"x-hop"}
            outcomes[name] = "forwarded"
    assert {name for name, outcome in outcomes.items() if outcome == "forwarded"} == FORWARDED


# -- the pure screens, as tables ---------------------------------------------------------------

SCREENED = [
    # (body, None: accepted up to its end | (status, words in the message))
    (b"0\r\n\r\n", None),
    (b"3\r\nabc\r\n0\r\n\r\n", None),
    (b"3;a=b;c\r\nabc\r\n0\r\n\r\n", None),
    (b'3;a=\t"q"\r\nabc\r\n0\r\n\r\n', None),  # HTAB is allowed
    (b"A\r\n0123456789\r\n0\r\nX-T: y\r\nX-U: z\r\n\r\n", None),
    (b"0;last\r\n\r\n", None),
    (b"f" * 20 + b"\r\n", (413, "too large")),  # 20 digits: h11's bound, and over the limit
    (b"f" * 21 + b"\r\n", (400, "chunk size line")),
    (b"\r\nabc\r\n", (400, "chunk size line")),
    (b"zz\r\n", (400, "chunk size line")),
    (b"3 \r\nabc\r\n0\r\n\r\n", (400, "chunk size line")),
    (b"3\t;a\r\nabc\r\n0\r\n\r\n", (400, "chunk size line")),
    (b"3\nabc\r\n", (400, "chunk size line")),
    (b"3\rabc\r\n", (400, "bare CR")),
    (b"3;a\nb\r\nabc\r\n", (400, "extension")),
    (b"3;a\rb\r\nabc\r\n", (400, "bare CR")),
    (b"3;\x7f\r\nabc\r\n", (400, "extension")),
    (b"3\r\nabcd\r\n", (400, "not ended by CRLF")),
    (b"3\r\nabc\n0\r\n\r\n", (400, "not ended by CRLF")),
    (b"0\r\n\n", (400, "bare LF")),
    (b"0\r\nX-T: y\n\n", (400, "trailer")),
    (b"0\r\nX-T: y\r\n\n", (400, "bare LF")),
    (b"0\r\n\r\r\n", (400, "bare CR")),
    (b"0\r\n X: y\r\n\r\n", (400, "folding")),
    (b"0\r\n\tX: y\r\n\r\n", (400, "folding")),
    (b"0\r\n\x01X: y\r\n\r\n", (400, "trailer")),
    (b"0\r\nX: \x1b\r\n\r\n", (400, "trailer")),
]


def screen_in_reads(body: bytes, reads: Sequence[int], max_body: int = 1000) -> int | ClientError:
    """Feed ``body`` to a fresh ``ChunkScreen`` in reads of the given sizes (cycled)."""
    screen = ChunkScreen(max_body)
    pos = 0
    try:
        for size in itertools.cycle(reads):
            part = memoryview(body)[pos : pos + size]
            used = screen.feed(part)
            if screen.done:
                return pos + used
            assert used == len(part)
            pos += len(part)
            if pos >= len(body):
                return -1  # wants more
    except ClientError as exc:
        return exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("body", "verdict"), SCREENED, ids=[repr(b) for b, _ in SCREENED])
@pytest.mark.parametrize("reads", [[1 << 20], [1], [2, 3], [5, 1, 7]], ids=str)
def test_the_chunk_screen_judges_the_same_in_any_reads(
    body: bytes, verdict: tuple[int, str] | None, reads: list[int]
) -> None:
    rest = b"GET / HTTP/1.1\r\n\r\n"  # a pipelined next request: not the body's
    result = screen_in_reads(body + rest, reads)
    if verdict is None:
        assert result == len(body)
    else:
        assert isinstance(result, ClientError), result
        assert (result.status, verdict[1] in str(result)) == (verdict[0], True)


@pytest.mark.parametrize(
    ("body", "counted", "verdict"),
    [
        (b"5\r\nabcde\r\n0\r\n\r\n", 5, None),
        (b"5;abc\r\nabcde\r\n0\r\n\r\n", 8, None),  # the extension after its ";"
        (b"5\r\nabcde\r\n0\r\nX: y\r\n\r\n", 9, None),  # the trailer line, no CRLF
        (b"9\r\n", 9, 413),  # a declared size over the limit is refused at once
        (b"1;" + b"e" * 9 + b"\r\n", 9, 413),
        (b"0\r\n" + b"X" * 10, 10, 413),
    ],
)
def test_the_chunk_screen_counts_data_extensions_and_trailers(
    body: bytes, counted: int, verdict: int | None
) -> None:
    screen = ChunkScreen(8)
    if verdict is None:
        screen = ChunkScreen(counted)
        assert screen.feed(body) == len(body)
        assert screen.done
    else:
        with pytest.raises(ClientError) as caught:
            screen.feed(body)
        assert caught.value.status == verdict
    assert screen.counted == counted


@given(
    st.lists(
        st.tuples(
            st.binary(min_size=1, max_size=12),  # a size 0 is the last chunk
            st.sampled_from([b"", b";a", b";a=b", b" ", b";\r", b"\t", b";\x01", b";\n"]),
            st.sampled_from([b"\r\n", b"\n", b"\r\r\n", b"\r"]),
        ),
        max_size=4,
    ),
    st.sampled_from([b"", b"X-T: y\r\n", b"X-T: y\n", b" X: y\r\n", b"X-T: \x7f\r\n"]),
    st.sampled_from([b"\r\n", b"\n", b"\r"]),
    st.sampled_from([[1 << 20], [1], [3, 1]]),
)
@settings(max_examples=300, deadline=None)
def test_what_the_chunk_screen_accepts_h11_reads_the_same(
    chunks: list[tuple[bytes, bytes, bytes]], trailer: bytes, end: bytes, reads: list[int]
) -> None:
    # The screen only refuses; where it accepts, h11 must end the body at
    # the same byte with the same data, or the two parsers disagree.
    body = b"".join(b"%x%s%s%s\r\n" % (len(data), ext, eol, data) for data, ext, eol in chunks)
    body += b"0\r\n" + trailer + end
    rest = b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n"
    result = screen_in_reads(body + rest, reads)
    if not isinstance(result, int) or result < 0:
        return  # refused, or not ended: h11 never gets to read it as a body
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
    conn.receive_data(body + rest)
    assert isinstance(conn.next_event(), h11.Request)
    data = b""
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        assert isinstance(event, h11.Data)
        data += event.data
    assert data == b"".join(data for data, _, _ in chunks if data)
    assert conn.trailing_data[0] == rest
    assert result == len(body)


@pytest.mark.parametrize(
    ("head", "refused"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: a\tb\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: caf\xc3\xa9\r\n\r\n", False),  # obs-text
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: \x01\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: \x1b[0m\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: \x7f\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: \x0c\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: \x00\r\n\r\n", True),
    ],
)
def test_the_head_screen_refuses_control_bytes_but_htab(head: bytes, refused: bool) -> None:
    if refused:
        with pytest.raises(ClientError, match="control character") as caught:
            screen_head(head, 4096)
        assert caught.value.status == 400
    else:
        screen_head(head, 4096)


@pytest.mark.parametrize(
    ("reason", "headers", "flaw"),
    [
        (b"OK", [(b"x-a", b"a\tb"), (b"x-b", b"caf\xc3\xa9")], None),
        (b"", [], None),
        (b"O\x01K", [], "control character in the reason phrase"),
        (b"OK\x7f", [], "control character in the reason phrase"),
        (b"OK", [(b"x-a", b"ok"), (b"x-b", b"\x1b")], "control character in a header value"),
    ],
)
def test_answer_flaws(reason: bytes, headers: list[tuple[bytes, bytes]], flaw: str | None) -> None:
    assert answer_flaw(reason, headers) == flaw


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ("illegal status line: bytearray(b'POISON-D')", "illegal status line"),
        ("illegal header line: b'X: \\x01'", "illegal header line"),
        ("malformed chunk footer: bytearray(b'xy') (expected b'\\r\\n')", "malformed chunk footer"),
        (
            "peer closed connection without sending complete message body (received 1 bytes, "
            "expected 2)",
            "peer closed connection without sending complete message body (received 1 bytes, "
            "expected 2)",
        ),
        ("Receive buffer too long", "Receive buffer too long"),
        ("b'everything'", "malformed answer"),
    ],
)
def test_h11_messages_lose_the_bytes_they_quote(message: str, kept: str) -> None:
    assert without_peer_bytes(message) == kept
