"""A fleet of one fake node behind the proxy, over real 127.0.0.1 sockets,
with the client keys and admin token that the auth tests use.

The node speaks both APIs: OpenAI's (``/v1/...``, SSE when ``"stream":
true``) and Ollama's native chat (``/api/...``, NDJSON unless ``"stream":
false``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from trio_failover import ClientKey, Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.telemetry.events import Subscription
from trio_failover.testing import FakeNode, Fleet, NodeIO, ReceivedRequest, healthy, openai

# None of them shaped like "Bearer <token>" where it stands alone: the log
# formatters scrub that pattern, and a leak must not hide behind it.
ALICE_KEY = "ka-3f9e1c07d2b84a65"
BOB_KEY = "kb-81c4e2a9f0d3b756"
WRONG_KEY = "kx-00aa11bb22cc33dd"
TOKEN = "adm-5d2e8b1f7c40a963"
CLIENTS = (ClientKey("alice", ALICE_KEY), ClientKey("bob", BOB_KEY))
LIMIT = 20.0
MODEL = "m"


def ollama_chat(io: NodeIO, request: ReceivedRequest) -> Any:
    """Ollama's native /api/chat: NDJSON lines unless ``"stream": false``."""
    document = request.json() if request.body else {}

    def line(content: str, done: bool) -> bytes:
        message = {"role": "assistant", "content": content}
        return json.dumps(
            {"model": MODEL, "created_at": "2026-12-01T00:00:00Z", "message": message, "done": done}
        ).encode()

    if document.get("stream", True):
        chunks = [line("hel", False) + b"\n", line("lo", False) + b"\n", line("", True) + b"\n"]
        return healthy(chunks, headers=(("content-type", "application/x-ndjson"),))(io, request)
    return healthy(line("hello", True))(io, request)


def both_apis(io: NodeIO, request: ReceivedRequest) -> Any:
    if request.target.startswith(b"/api/"):
        return ollama_chat(io, request)
    return openai(MODEL, tokens=3)(io, request)


TERMINAL = {"completed", "failed", "cancelled"}


@attrs.frozen
class Running:
    bound: BoundAddresses
    node: FakeNode
    proxy: Proxy
    events: Subscription  # every event since the start, unbounded

    @property
    def admin_url(self) -> str:
        assert self.bound.admin_url is not None
        return self.bound.admin_url

    async def finished(self, count: int = 1) -> list[dict[str, Any]]:
        """Every event up to the ``count``-th terminal workload event.

        The client may have its answer before the proxy has written it into
        ``/status`` and the logs; this waits for the proxy's own word.
        """
        seen: list[dict[str, Any]] = []
        while count:
            event = await self.events.receive.receive()
            seen.append(event)
            count -= event["type"] == "workload" and event["state"] in TERMINAL
        return seen


@asynccontextmanager
async def running(
    *,
    node_headers: dict[str, str] | None = None,
    before: Sequence[Upstream] = (),
    **settings: Any,
) -> AsyncIterator[Running]:
    """The proxy over real 127.0.0.1 sockets in front of one fake node.

    Args:
        node_headers: the fake node's configured ``headers``.
        before: nodes ranked before it (a dead one makes every request fail over).
        settings: more ``Config`` fields.
    """
    settings.setdefault("discovery_interval", 0)  # the node's requests are counted
    async with Fleet({"n": FakeNode(both_apis)}) as fleet, trio.open_nursery() as nursery:
        upstream = await fleet.serve_tcp("n")
        upstream = attrs.evolve(upstream, headers=node_headers or {})
        config = Config(
            upstreams=[*before, upstream],
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            **settings,
        )
        proxy = Proxy(config)
        with proxy.events.subscribe(0) as events:
            bound: BoundAddresses = await nursery.start(
                functools.partial(serve, config, proxy=proxy)
            )
            yield Running(bound, fleet["n"], proxy, events)
            nursery.cancel_scope.cancel()


def chat_body(path: str, stream: bool) -> bytes:
    return json.dumps(
        {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
