"""Fault-injecting fake nodes and an in-memory connector, for deterministic tests.

A ``FakeNode`` reads each request with h11, records it, and answers by its
*behaviour*: ``healthy``, ``frozen``, ``frozen_after_head``,
``frozen_mid_stream``, ``headers_then_silence``, ``partial_head_then_stall``,
``drop_before_body``, ``slow_head``,
``slow_prefill_with_pings``, ``die_mid_stream``, ``retry_status``,
``PromptCache`` (an engine's prompt cache: prefill time by the uncached part),
``openai`` (``with_health`` adds an answer to ``GET /health``, a liveness
check, to any of them); the fake engines ``FakeLlamaServer``,
``FakeLlamaCppPython``, ``FakeOllama``,
``FakeVllm`` and ``FakeLmStudio`` answer their signal reads from their own
slots and loaded models. The same node serves over an in-memory stream
(``Fleet.connector``, under ``MockClock``) or a real socket
(``Fleet.serve_tcp``).

    async with Fleet({"a": FakeNode(frozen()), "b": FakeNode(healthy(b"hi"))}) as fleet:
        async with Proxy(config, connector=fleet.connector) as proxy:
            response = await request(proxy, b"POST", "/v1/chat", body=b"{}")

A proxy serves only while its own tasks run (``async with``, ``open_proxy``,
``Proxy.run``). ``request`` starts one that does not run yet, if it reaches
its nodes through a fleet's connector, in that fleet's nursery
(``start_in_fleet``): it then runs until the fleet's block ends, its tasks
all but discovery's checks (a test that wants them enters the proxy itself).

Import every name from here. The fake nodes and their behaviours live in
``fakes.py``, the fake engines in ``engines.py``, ``HeldRequests`` in
``held.py``; ``Fleet``, the connector and the test clients in this file.
The kit may import ``service/`` and the layers below it; the shipped
proxy never imports the kit (only the demo and tests do).
"""

from __future__ import annotations

import errno
import functools
import json
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio
import trio.testing

from ..core.config import Upstream
from ..core.headers import get
from ..proxy.proxy import Proxy
from ..wire.http1 import send_events
from .engines import (
    FakeEngine,
    FakeLlamaCppPython,
    FakeLlamaServer,
    FakeLmStudio,
    FakeOllama,
    FakeVllm,
)
from .fakes import (
    Behaviour,
    FakeNode,
    NodeIO,
    ReceivedRequest,
    die_mid_stream,
    drop_before_body,
    frozen,
    frozen_after_head,
    frozen_mid_stream,
    headers_then_silence,
    healthy,
    openai,
    partial_head_then_stall,
    retry_status,
    slow_head,
    slow_prefill,
    slow_prefill_with_pings,
    stream_then_silence,
    with_health,
)
from .held import HeldRequests
from .prompt_cache import PromptCache

# The fakes live in fakes.py, engines.py and held.py; tests import them from here.
__all__ = [
    "Behaviour",
    "ClientResponse",
    "FakeEngine",
    "FakeLlamaCppPython",
    "FakeLlamaServer",
    "FakeLmStudio",
    "FakeNode",
    "FakeOllama",
    "FakeVllm",
    "Fleet",
    "HeldRequests",
    "MemoryConnector",
    "NodeIO",
    "PromptCache",
    "ReceivedRequest",
    "die_mid_stream",
    "drop_before_body",
    "frozen",
    "frozen_after_head",
    "frozen_mid_stream",
    "headers_then_silence",
    "healthy",
    "openai",
    "partial_head_then_stall",
    "read_response",
    "request",
    "request_node",
    "request_tcp",
    "retry_status",
    "slow_head",
    "slow_prefill",
    "slow_prefill_with_pings",
    "start_in_fleet",
    "stream_then_silence",
    "with_health",
]

Headers = list[tuple[bytes, bytes]]


# -- fleets and connectors ----------------------------------------------------


class MemoryConnector:
    """Connects the proxy to fake nodes over in-memory streams (no sockets)."""

    def __init__(self, nodes: Mapping[str, FakeNode], nursery: trio.Nursery) -> None:
        self._nodes = nodes
        # The fleet's: the fake nodes' connections run there, and a proxy
        # that ``request`` starts (``start_in_fleet``).
        self.nursery = nursery

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        fake = self._nodes[node.name]
        await trio.lowlevel.checkpoint()
        if fake.refuse:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")
        proxy_side, node_side = trio.testing.memory_stream_pair()
        self.nursery.start_soon(fake.serve_connection, node_side)
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
        value = get(self.headers, name.lower().encode())
        return None if value is None else value.decode("latin-1")

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
    if isinstance(proxy.connector, MemoryConnector):
        await start_in_fleet(proxy)  # else handle_connection lends it its tasks
    events = _request_events(method, target, b"proxy.test", headers, body)
    return await _exchange_in_memory(proxy.handle_connection, events, leave_after)


async def start_in_fleet(proxy: Proxy, *, discovery: bool = False) -> Proxy:
    """Run ``proxy`` (``Proxy.run``) in the nursery of the fleet it connects through.

    Does nothing when it runs already. Its tasks then end, and its pool
    closes, with the fleet's block. Without ``discovery`` it runs no
    checks (whatever ``discovery_interval`` says): the fake nodes see only
    the test's own requests.

    Raises:
        RuntimeError: it does not run and its connector is no fleet's.
    """
    connector = proxy.connector
    # Requests that a test sends at once all find it not running yet: one
    # starts it, the others wait for that.
    async with _STARTING.setdefault(proxy, trio.Lock()):
        if proxy.running:
            return proxy
        if not isinstance(connector, MemoryConnector):
            raise RuntimeError(
                "this Proxy does not run and has no fleet to run in: use 'async with proxy'"
            )
        run = functools.partial(proxy.run, discovery=discovery)
        started: Proxy = await connector.nursery.start(run)
        return started


_STARTING: weakref.WeakKeyDictionary[Proxy, trio.Lock] = weakref.WeakKeyDictionary()


async def request_node(
    node: FakeNode,
    method: str = "GET",
    target: str = "/",
    *,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    leave_after: float | None = None,
) -> ClientResponse | None:
    """Send one request straight to a fake ``node``, past any proxy.

    For the work of other clients that an engine's own signals show and the
    proxy's count does not, and to read a fake engine's answers in tests.
    ``leave_after`` as for ``request``: it returns None once the client has
    left, and the node's side of that connection ends then too (a behaviour
    that would hold the request on, as ``HeldRequests()`` does, is cancelled).
    """
    events = _request_events(method, target, b"node.test", headers, body)
    return await _exchange_in_memory(
        node.serve_connection, events, leave_after, end_server_on_leave=True
    )


async def _exchange_in_memory(
    serve: Callable[[trio.abc.Stream], Awaitable[object]],
    events: Sequence[h11.Event],
    leave_after: float | None,
    *,
    end_server_on_leave: bool = False,
) -> ClientResponse | None:
    """One request over an in-memory connection that ``serve`` answers (None: the client left).

    A proxy ends its side of a connection whose client left by itself, and
    is waited for; with ``end_server_on_leave`` (a fake node, which may hold
    a request past its client) the server's task is cancelled instead.
    """
    client, server = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, server)
        await send_events(client, conn, *events)
        if leave_after is not None:
            await trio.sleep(leave_after)
            await client.aclose()
            if end_server_on_leave:
                nursery.cancel_scope.cancel()
            return None
        response = await read_response(client, conn)
        await client.aclose()
    return response


def _request_events(
    method: str, target: str, host: bytes, headers: Sequence[tuple[str, str]], body: bytes
) -> list[h11.Event]:
    """A test client's request as h11 events (``Content-Length`` added where a body goes)."""
    head = [(b"host", host)] + [(k.encode(), v.encode()) for k, v in headers]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append((b"content-length", b"%d" % len(body)))
    events: list[h11.Event] = [h11.Request(method=method, target=target, headers=head)]
    if body:
        events.append(h11.Data(data=body))
    return [*events, h11.EndOfMessage()]


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
    try:
        events = _request_events(method, target, authority.encode(), headers, body)
        await send_events(stream, conn, *events)
        if leave_after is not None:
            await trio.sleep(leave_after)
            return None
        return await read_response(stream, conn)
    finally:
        await trio.aclose_forcefully(stream)
