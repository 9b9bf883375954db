"""Fault-injecting fake nodes and an in-memory connector, for deterministic tests.

A ``FakeNode`` reads each request with h11, records it, and answers by its
*behaviour*: ``healthy``, ``frozen``, ``headers_then_silence``,
``partial_head_then_stall``, ``drop_before_body``, ``slow_head``,
``die_mid_stream``, ``retry_status``, ``openai``. The same node serves over
an in-memory stream (``Fleet.connector``, under ``MockClock``) or a real
socket (``Fleet.serve_tcp``).

    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"hi"))}) as fleet:
        proxy = Proxy(config, connector=fleet.connector)
        response = await request(proxy, b"POST", "/v1/chat", body=b"{}")
"""

from __future__ import annotations

import errno
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio
import trio.testing

from .core.config import Upstream
from .proxy.proxy import Proxy
from .wire.http1 import next_event

Headers = list[tuple[bytes, bytes]]


@attrs.frozen
class ReceivedRequest:
    """A request as a fake node saw it."""

    method: bytes
    target: bytes
    headers: Headers
    body: bytes
    at: float

    def header(self, name: str) -> bytes | None:
        """The first value of header ``name`` (any case)."""
        key = name.lower().encode()
        return next((value for n, value in self.headers if n == key), None)

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


class NodeIO:
    """What a behaviour may do with its connection: send bytes, h11 events, wait."""

    def __init__(self, stream: trio.abc.Stream, conn: h11.Connection, node: FakeNode) -> None:
        self.stream = stream
        self.conn = conn
        self.node = node

    async def send(self, *events: h11.Event) -> None:
        await self.stream.send_all(b"".join(self.conn.send(event) or b"" for event in events))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def pause(self, seconds: float) -> None:
        """Stay silent for ``seconds`` while noticing a close, as real servers do.

        Raises:
            trio.BrokenResourceError: the proxy closed the connection meanwhile.
        """
        with trio.move_on_after(seconds):
            await self.wait_closed()
            raise trio.BrokenResourceError("the proxy closed the connection")

    async def wait_closed(self) -> None:
        """Wait until the proxy closes the connection (EOF or error)."""
        try:
            while await self.stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


Behaviour = Callable[[NodeIO, ReceivedRequest], Awaitable[None]]


class FakeNode:
    """A fake inference node. ``refuse=True`` makes connects fail like a closed port."""

    def __init__(self, behaviour: Behaviour | None = None, *, refuse: bool = False) -> None:
        self.behaviour = behaviour or healthy()
        self.refuse = refuse
        self.received: list[ReceivedRequest] = []
        self.connections = 0
        self.closed_at: list[float] = []
        self.first_request = trio.Event()

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it closes."""
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        io = NodeIO(stream, conn, self)
        try:
            while True:
                request = await _read_request(stream, conn)
                if request is None:
                    break
                self.received.append(request)
                self.first_request.set()
                await self.behaviour(io, request)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
            await io.wait_closed()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass
        finally:
            self.closed_at.append(trio.current_time())
            await trio.aclose_forcefully(stream)


async def _read_request(stream: trio.abc.Stream, conn: h11.Connection) -> ReceivedRequest | None:
    head: h11.Request | None = None
    parts: list[bytes] = []
    while True:
        event = await next_event(stream, conn, strict_eof=False)
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage) and head is not None:
            return ReceivedRequest(
                head.method, head.target, list(head.headers), b"".join(parts), trio.current_time()
            )
        else:
            return None


# -- behaviours ---------------------------------------------------------------


def healthy(
    body: bytes | Sequence[bytes] = b'{"ok": true}',
    *,
    status: int = 200,
    headers: Sequence[tuple[str, str]] = (("content-type", "application/json"),),
    chunk_delay: float = 0.0,
    head_delay: float = 0.0,
    content_length: bool = True,
) -> Behaviour:
    """Answers at once (or after ``head_delay``); a list of chunks streams them."""
    chunks = [body] if isinstance(body, bytes) else list(body)

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if head_delay:
            await io.pause(head_delay)
        head = [(k.encode(), v.encode()) for k, v in headers]
        if content_length and isinstance(body, bytes):
            head.append((b"content-length", b"%d" % len(body)))
        await io.send(h11.Response(status_code=status, headers=head))
        for index, chunk in enumerate(chunks):
            if index and chunk_delay:
                await io.pause(chunk_delay)
            if chunk:
                await io.send(h11.Data(data=chunk))
        await io.send(h11.EndOfMessage())

    return behave


def slow_head(delay: float, body: bytes = b'{"ok": true}') -> Behaviour:
    """Answers after ``delay`` seconds of silence (a long prefill before the head)."""
    return healthy(body, head_delay=delay)


def slow_prefill(delay: float, body: bytes = b'{"ok": true}') -> Behaviour:
    """A node busy with a long prefill: silent for ``delay`` seconds, then a normal answer.

    The name SPEC section 7 uses; the same node as ``slow_head``.
    """
    return slow_head(delay, body)


def frozen() -> Behaviour:
    """Accepts and reads the request, never answers."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.wait_closed()

    return behave


def headers_then_silence(silence: float, body: bytes = b"late body") -> Behaviour:
    """Sends the head at once, the body after ``silence`` seconds."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-length", b"%d" % len(body))])
        )
        await io.pause(silence)
        await io.send(h11.Data(data=body), h11.EndOfMessage())

    return behave


def partial_head_then_stall(partial: bytes = b"HTTP/1.1 200 OK\r\nContent-") -> Behaviour:
    """Sends part of a head, then nothing."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send_raw(partial)
        await io.wait_closed()

    return behave


def drop_before_body() -> Behaviour:
    """Sends a complete head, then closes before any body byte."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send_raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        await io.stream.aclose()

    return behave


def die_mid_stream(chunks: int = 3, delay: float = 0.0) -> Behaviour:
    """Streams ``chunks`` SSE events, then closes without ending the body."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        )
        for index in range(chunks):
            if delay:
                await io.pause(delay)
            await io.send(h11.Data(data=b"data: %d\n\n" % index))
        await io.stream.aclose()

    return behave


def stream_then_silence(chunks: int, silence: float) -> Behaviour:
    """Streams ``chunks`` SSE events, then stays silent for ``silence`` seconds, then ends."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        )
        for index in range(chunks):
            await io.send(h11.Data(data=b"data: %d\n\n" % index))
        await io.pause(silence)
        await io.send(h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())

    return behave


def retry_status(
    status: int = 503,
    body: bytes = b'{"error": {"message": "busy", "code": "overloaded"}}',
    headers: Sequence[tuple[str, str]] = (),
) -> Behaviour:
    """Answers with ``status`` (a 429, a 503, a 400 with an error code...)."""
    return healthy(body, status=status, headers=(("content-type", "application/json"), *headers))


def openai(model: str = "fake-model", *, tokens: int = 5, token_delay: float = 0.0) -> Behaviour:
    """An OpenAI-compatible chat completion node: JSON, or SSE when ``"stream": true``."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if request.target.endswith(b"/models"):
            listing = {"object": "list", "data": [{"id": model, "object": "model"}]}
            await healthy(json.dumps(listing).encode())(io, request)
            return
        document = request.json() if request.body else {}
        words = [f"word{i} " for i in range(tokens)]
        if not document.get("stream"):
            completion = _completion(model, "".join(words))
            await healthy(json.dumps(completion).encode())(io, request)
            return
        events = [
            b"data: " + json.dumps(_chunk(model, {"content": word})).encode() + b"\n\n"
            for word in words
        ]
        events.append(b"data: " + json.dumps(_chunk(model, {}, "stop")).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        await healthy(
            events, headers=(("content-type", "text/event-stream"),), chunk_delay=token_delay
        )(io, request)

    return behave


def _completion(model: str, text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _chunk(model: str, delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


# -- fleets and connectors ----------------------------------------------------


class MemoryConnector:
    """Connects the proxy to fake nodes over in-memory streams (no sockets)."""

    def __init__(self, nodes: Mapping[str, FakeNode], nursery: trio.Nursery) -> None:
        self._nodes = nodes
        self._nursery = nursery

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        fake = self._nodes[node.name]
        await trio.lowlevel.checkpoint()
        if fake.refuse:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")
        proxy_side, node_side = trio.testing.memory_stream_pair()
        self._nursery.start_soon(fake.serve_connection, node_side)
        return proxy_side


class Fleet:
    """A set of fake nodes, by name, with the nursery their connections run in."""

    def __init__(self, nodes: Mapping[str, FakeNode]) -> None:
        self.nodes = dict(nodes)
        self._nursery: trio.Nursery | None = None

    def __getitem__(self, name: str) -> FakeNode:
        return self.nodes[name]

    @property
    def connector(self) -> MemoryConnector:
        assert self._nursery is not None, "use the fleet as 'async with Fleet(...) as fleet'"
        return MemoryConnector(self.nodes, self._nursery)

    def upstreams(self) -> list[Upstream]:
        """One ``Upstream`` per fake node (URLs are placeholders for memory use)."""
        return [Upstream(name, f"http://{name}.invalid:80") for name in self.nodes]

    async def serve_tcp(self, name: str, host: str = "127.0.0.1", port: int = 0) -> Upstream:
        """Serve node ``name`` on a real socket; returns its ``Upstream``."""
        assert self._nursery is not None

        async def handler(stream: trio.SocketStream) -> None:
            # Looked up per connection, so a test may swap the node's behaviour.
            await self.nodes[name].serve_connection(stream)

        listeners = await self._nursery.start(
            functools.partial(trio.serve_tcp, handler, port, host=host)
        )
        bound = listeners[0].socket.getsockname()
        return Upstream(name, f"http://{bound[0]}:{bound[1]}")

    async def __aenter__(self) -> Fleet:
        self._manager = _open_nursery()
        self._nursery = await self._manager.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        return await self._manager.__aexit__(*exc_info)


@asynccontextmanager
async def _open_nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        yield nursery


# -- a client for in-memory tests ---------------------------------------------


@attrs.frozen
class ClientResponse:
    """What a test client received."""

    status: int
    headers: Headers
    body: bytes
    chunks: list[tuple[float, bytes]]
    complete: bool
    at: float

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for n, v in self.headers if n == key), None)

    def json(self) -> Any:
        return json.loads(self.body)


async def request(
    proxy: Proxy,
    method: str = "POST",
    target: str = "/v1/chat/completions",
    *,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    leave_after: float | None = None,
) -> ClientResponse | None:
    """Send one request to ``proxy`` over an in-memory connection.

    ``leave_after`` closes the client connection after that many seconds
    (a client that gives up); the function then returns None.
    """
    client, server = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    head = [(b"host", b"proxy.test")] + [(k.encode(), v.encode()) for k, v in headers]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append((b"content-length", b"%d" % len(body)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(proxy.handle_connection, server)
        data = conn.send(h11.Request(method=method, target=target, headers=head))
        data += conn.send(h11.Data(data=body)) if body else b""
        data += conn.send(h11.EndOfMessage())
        await client.send_all(data)
        if leave_after is not None:
            await trio.sleep(leave_after)
            await client.aclose()
            return None
        response = await read_response(client, conn)
        await client.aclose()
    return response


async def read_response(stream: trio.abc.Stream, conn: h11.Connection) -> ClientResponse:
    """Read one response with ``conn``; an early close gives ``complete=False``."""
    head: h11.Response | None = None
    chunks: list[tuple[float, bytes]] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            conn.receive_data(bytes(data))
            if not data:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError:
                    event = h11.ConnectionClosed()
                if isinstance(event, h11.ConnectionClosed) or event is h11.NEED_DATA:
                    break
            else:
                continue
        if isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            chunks.append((trio.current_time(), bytes(event.data)))
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            return _response(head, chunks, complete=True)
        elif isinstance(event, h11.ConnectionClosed):
            break
    if head is None:
        raise ConnectionError("the proxy closed the connection without a response")
    return _response(head, chunks, complete=False)


def _response(
    head: h11.Response, chunks: list[tuple[float, bytes]], *, complete: bool
) -> ClientResponse:
    return ClientResponse(
        status=head.status_code,
        headers=list(head.headers),
        body=b"".join(chunk for _, chunk in chunks),
        chunks=chunks,
        complete=complete,
        at=trio.current_time(),
    )


# -- a client for real sockets ------------------------------------------------


class _ChunkReporter(h11.Connection):
    """An h11 client connection that reports each body chunk as it is parsed.

    Hooking ``next_event`` lets ``read_response`` stay the one reader of
    responses, while a caller still sees a stream's chunks live.
    """

    def __init__(self, on_chunk: Callable[[bytes], None]) -> None:
        super().__init__(h11.CLIENT)
        self._on_chunk = on_chunk

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Data) and event.data:
            self._on_chunk(bytes(event.data))
        return event


async def request_tcp(
    address: tuple[str, int],
    method: str = "POST",
    target: str = "/v1/chat/completions",
    *,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    leave_after: float | None = None,
    on_chunk: Callable[[bytes], None] | None = None,
) -> ClientResponse | None:
    """Send one request over a real TCP connection to ``address`` (a proxy or a node).

    The same as ``request`` but through a socket, for servers started with
    ``trio_failover.serve`` or ``Fleet.serve_tcp``. It sets no deadline of
    its own: wrap it in ``trio.fail_after``.

    Args:
        address: ``(host, port)``, e.g. ``BoundAddresses.client``.
        method, target, body, headers: the request (``Content-Length`` is added).
        leave_after: close the connection after that many seconds and return
            None (a client that gives up).
        on_chunk: called with each body chunk as it arrives (to show a stream live).

    Returns:
        The response (``complete=False`` if the connection ended early), or
        None when ``leave_after`` was given.
    """
    host, port = address
    stream = await trio.open_tcp_stream(host, port)
    conn = _ChunkReporter(on_chunk) if on_chunk else h11.Connection(h11.CLIENT)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    head = [(b"host", authority.encode())] + [(k.encode(), v.encode()) for k, v in headers]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append((b"content-length", b"%d" % len(body)))
    try:
        data = conn.send(h11.Request(method=method, target=target, headers=head)) or b""
        data += (conn.send(h11.Data(data=body)) or b"") if body else b""
        data += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(data)
        if leave_after is not None:
            await trio.sleep(leave_after)
            return None
        return await read_response(stream, conn)
    finally:
        await trio.aclose_forcefully(stream)
