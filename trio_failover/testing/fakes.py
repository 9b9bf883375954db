"""Fake nodes for tests: a ``FakeNode`` answers each request by its behaviour.

Part of the test kit; import the names from ``trio_failover.testing``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import h11
import trio

from ..core.headers import get
from ..wire.http1 import next_event

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
        return get(self.headers, name.lower().encode())

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


def is_health(request: ReceivedRequest) -> bool:
    """Whether ``request`` is a ``GET /health`` (under any base path): a liveness check."""
    return request.method == b"GET" and request.target.split(b"?", 1)[0].endswith(b"/health")


def with_health(
    behaviour: Behaviour, *, status: int = 200, answers: int | None = None
) -> Behaviour:
    """``behaviour``, but ``GET /health`` answered at once with ``status``, as a live engine's.

    An engine's web server answers its health route while the model works
    (llama-server, vLLM). ``answers``: only the first that many checks are
    answered; later ones are read and never answered (the process froze).
    """
    answered = 0

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        nonlocal answered
        if not is_health(request):
            await behaviour(io, request)
        elif answers is None or answered < answers:
            answered += 1
            await healthy(b'{"status": "ok"}', status=status)(io, request)
        else:
            await io.wait_closed()

    return behave


def slow_head(delay: float, body: bytes = b'{"ok": true}') -> Behaviour:
    """Answers after ``delay`` seconds of silence (a long prefill before the head).

    A live node: ``GET /health`` is answered at once (``with_health``).
    """
    return with_health(healthy(body, head_delay=delay))


def slow_prefill(delay: float, body: bytes = b'{"ok": true}') -> Behaviour:
    """A node busy with a long prefill: silent for ``delay`` seconds, then a normal answer.

    Another name for ``slow_head``: the same node (it answers
    ``GET /health`` at once).
    """
    return slow_head(delay, body)


def frozen() -> Behaviour:
    """Accepts and reads every request, answers none: ``GET /health`` included.

    A stopped (SIGSTOP) or wedged process: the kernel still accepts its
    connections, so a liveness check of it gets no answer either.
    """

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.wait_closed()

    return behave


def frozen_after_head(content_type: str = "text/event-stream") -> Behaviour:
    """Sends a head at once, then nothing; ``GET /health`` gets no answer at all.

    A process that froze right after it sent the head of a stream.
    """

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if not is_health(request):
            headers = [(b"content-type", content_type.encode())]
            await io.send(h11.Response(status_code=200, headers=headers))
        await io.wait_closed()

    return behave


def headers_then_silence(silence: float, body: bytes = b"late body") -> Behaviour:
    """Sends the head at once, the body after ``silence`` seconds.

    A live node at work: ``GET /health`` is answered at once (``with_health``).
    """

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-length", b"%d" % len(body))])
        )
        await io.pause(silence)
        await io.send(h11.Data(data=body), h11.EndOfMessage())

    return with_health(behave)


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
        await _numbered_events(io, chunks, delay)
        await io.stream.aclose()

    return behave


def frozen_mid_stream(chunks: int = 3) -> Behaviour:
    """Streams ``chunks`` SSE events, then freezes: nothing more, ``GET /health`` unanswered.

    An engine stopped (SIGSTOP, a hung driver) in the middle of a stream: the
    kernel keeps the connection open, nothing comes on it or on a new one.
    """

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if not is_health(request):
            await _numbered_events(io, chunks)
        await io.wait_closed()

    return behave


def stream_then_silence(chunks: int, silence: float) -> Behaviour:
    """Streams ``chunks`` SSE events, then stays silent for ``silence`` seconds, then ends.

    Its web server is alive: ``GET /health`` is answered at once (``with_health``).
    """

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await _numbered_events(io, chunks)
        await io.pause(silence)
        await io.send(h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())

    return with_health(behave)


def sse_head() -> h11.Response:
    """The head of a ``200`` SSE stream."""
    return h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])


async def _numbered_events(io: NodeIO, chunks: int, delay: float = 0.0) -> None:
    """The SSE head, then ``chunks`` events ``data: 0``, ``data: 1``..., ``delay`` s apart."""
    await io.send(sse_head())
    for index in range(chunks):
        if delay:
            await io.pause(delay)
        await io.send(h11.Data(data=b"data: %d\n\n" % index))


def slow_prefill_with_pings(
    prefill: float,
    *,
    ping_every: float = 15.0,
    ping: bytes = b": ping\r\n\r\n",
    events: Sequence[bytes] = (b"data: {}\r\n\r\n", b"data: [DONE]\r\n\r\n"),
    stuck_after: int | None = None,
) -> Behaviour:
    """An engine that pings while it reads a long prompt, then streams ``events``.

    Sends an SSE head at once, a ``ping`` comment every ``ping_every``
    seconds until ``prefill`` seconds have passed, then the events (as
    llama-cpp-python's server does, every 15 s, with CRLF line ends). With
    ``stuck_after=N`` the model hangs after ``N`` events while the web
    server goes on pinging, until the proxy closes the connection.
    """

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send(sse_head())
        waited = 0.0
        while waited + ping_every < prefill:
            await io.pause(ping_every)
            waited += ping_every
            await io.send(h11.Data(data=ping))
        await io.pause(prefill - waited)
        for index, event in enumerate(events):
            if index == stuck_after:
                while True:  # bounded by the proxy, which closes the connection
                    await io.pause(ping_every)
                    await io.send(h11.Data(data=ping))
            await io.send(h11.Data(data=event))
        await io.send(h11.EndOfMessage())

    return with_health(behave)


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
        prompt = prompt_tokens(document)
        if not document.get("stream"):
            completion = chat_completion(model, "".join(words), prompt, tokens)
            await healthy(json.dumps(completion).encode())(io, request)
            return
        events = [
            b"data: " + json.dumps(chat_chunk(model, {"content": word})).encode() + b"\n\n"
            for word in words
        ]
        events.append(b"data: " + json.dumps(chat_chunk(model, {}, "stop")).encode() + b"\n\n")
        if include_usage(document):
            events.append(usage_event(model, prompt, tokens))
        events.append(b"data: [DONE]\n\n")
        await healthy(
            events, headers=(("content-type", "text/event-stream"),), chunk_delay=token_delay
        )(io, request)

    return behave


def chat_completion(model: str, text: str, prompt: int = 1, completion: int = 1) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` answer of ``model`` saying ``text`` (for fake engines).

    ``prompt`` and ``completion``: the tokens its ``usage`` tells.
    """
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
        "usage": _usage(prompt, completion),
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage_chunk(model: str, prompt: int, completion: int) -> dict[str, Any]:
    """The last chunk of an OpenAI stream with ``stream_options.include_usage``: no choices."""
    return {**chat_chunk(model, {}), "choices": [], "usage": _usage(prompt, completion)}


def usage_event(model: str, prompt: int, completion: int) -> bytes:
    """``usage_chunk`` as its event."""
    return b"data: " + json.dumps(usage_chunk(model, prompt, completion)).encode() + b"\n\n"


def include_usage(document: Any) -> bool:
    """Whether a request asked for a stream's usage (``stream_options.include_usage``)."""
    options = document.get("stream_options") if isinstance(document, dict) else None
    return isinstance(options, dict) and options.get("include_usage") is True


def prompt_tokens(document: Any) -> int:
    """A request's prompt in the fakes' tokens: the words of its messages' contents and prompt."""
    if not isinstance(document, dict):
        return 0
    texts = [document.get("prompt")]
    messages = document.get("messages")
    if isinstance(messages, list):
        texts += [m.get("content") for m in messages if isinstance(m, dict)]
    return sum(len(text.split()) for text in texts if isinstance(text, str))


def chat_chunk(model: str, delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a streamed answer (``finish``: its reason, at the end)."""
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
