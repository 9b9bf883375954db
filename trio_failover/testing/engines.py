"""Fake engines for tests: llama-server, llama-cpp-python, Ollama, vLLM and LM Studio.

Part of the test kit; import the names from ``trio_failover.testing``. Each
fake is a behaviour (``FakeNode(FakeLlamaServer(slots=2))``) that keeps its
own state — slots in use, models loaded — and answers the engine's signal
reads from it, in the shapes recorded from the real llama-server and taken
from the other engines' source and docs (``tests/data/engines/README.md``).

Slots are what makes an engine's own count differ from the proxy's: a fake
with ``slots=N`` serves N completions at once and defers the rest as the
real one does (a streamed request gets its SSE head at once, then nothing
until a slot frees), and ``other_clients`` takes slots as work sent past
the proxy would.

A prompt longer than a fake's ``context`` (counted in words, the fakes'
tokens) gets that engine's own ``400`` (llama-server's as recorded in
tests/data/engines/llama-server/context-exceeded.json, vLLM's from its
source), at once.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import h11
import trio

from ..core.names import same_model
from .fakes import (
    NodeIO,
    ReceivedRequest,
    chat_chunk,
    chat_completion,
    healthy,
    include_usage,
    prompt_tokens,
    sse_head,
    usage_chunk,
    usage_event,
)

Route = Callable[[NodeIO, ReceivedRequest], Awaitable[None]]


async def _json(io: NodeIO, request: ReceivedRequest, document: object, status: int = 200) -> None:
    await healthy(json.dumps(document).encode(), status=status)(io, request)


class FakeEngine:
    """What the fakes share: slots, completions, and a route per signal read.

    Args:
        slots: completions served at once; the rest wait for a free slot.
        models: the model ids it serves.
        tokens: tokens in each answer.
        token_delay: seconds between tokens (the first comes after one delay).
        stream_head_first: a deferred streamed request gets its SSE head at
            once (vLLM's server starts its stream response before the
            engine schedules it); else only when its slot is free (the
            llama-server recorded here; Ollama and LM Studio while loading).
        context: the longest prompt it takes, in words (the fakes' tokens:
            every whitespace-separated word of the messages' contents and
            of ``prompt``); a longer one gets ``context_error``'s answer.

    Attributes:
        in_use: slots busy with this fake's own completions now.
        other_clients: slots taken by work that did not come through the
            proxy; a test sets it (``set_other_clients``).
        deferred: completions waiting for a slot now.
        served: completions finished, by model.
        interrupted: streams ended early for another request (``cut_short``).
        too_long: prompts refused as longer than ``context``.
    """

    def __init__(
        self,
        *,
        slots: int = 1,
        models: Sequence[str] = ("fake-model",),
        tokens: int = 5,
        token_delay: float = 0.0,
        stream_head_first: bool = True,
        context: int = 4096,
    ) -> None:
        self.slots = slots
        self.context = context
        self.too_long = 0
        self.models = list(models)
        self.tokens = tokens
        self.token_delay = token_delay
        self.stream_head_first = stream_head_first
        self.in_use = 0
        self.other_clients = 0
        self.deferred = 0
        self.served: list[str] = []
        self.interrupted = 0
        self._freed = trio.lowlevel.ParkingLot()

    @property
    def busy(self) -> int:
        """Slots processing now, whoever sent the work."""
        return min(self.slots, self.in_use + self.other_clients)

    def set_other_clients(self, count: int) -> None:
        """Let ``count`` slots be taken by clients that bypass the proxy."""
        self.other_clients = count
        self._freed.unpark_all()

    def routes(self) -> dict[tuple[bytes, bytes], Route]:
        """The engine's own GETs, by (method, path); completions are added by ``__call__``."""
        return {}

    async def __call__(self, io: NodeIO, request: ReceivedRequest) -> None:
        path = request.target.partition(b"?")[0]
        route = self.routes().get((request.method, path))
        if route is not None:
            await route(io, request)
        elif request.method == b"GET" and path == b"/v1/models":
            await _json(io, request, self.model_list())
        elif request.method == b"POST" and path.endswith(b"/completions"):
            await self.complete(io, request)
        else:
            await _json(io, request, {"error": {"message": "File Not Found", "code": 404}}, 404)

    def model_list(self) -> dict[str, Any]:
        """The ``GET /v1/models`` document."""
        data = [{"id": model, "object": "model", "owned_by": "fake"} for model in self.models]
        return {"object": "list", "data": data}

    async def before_slot(self, io: NodeIO, model: str) -> None:
        """Called before a completion waits for its slot (a cold load goes here)."""

    def context_error(self, prompt_tokens: int) -> tuple[int, dict[str, Any]]:
        """The status and body of the answer to a prompt over ``context``: OpenAI's shape.

        llama-cpp-python answers so too (``context_length_exceeded``); the
        llama-server and vLLM fakes answer their engines' own.
        """
        message = (
            f"This model's maximum context length is {self.context} tokens. However, you"
            f" requested {prompt_tokens} tokens ({prompt_tokens} in the messages, 0 in the"
            " completion). Please reduce the length of the messages or completion."
        )
        error = {
            "message": message,
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
        return 400, {"error": error}

    def cut_short(self) -> bool:
        """Whether a running stream ends now with ``[DONE]`` (llama-cpp-python's interruption)."""
        return False

    async def complete(self, io: NodeIO, request: ReceivedRequest) -> None:
        """A chat completion: waits for a slot, holds it while it answers."""
        document = request.json() if request.body else {}
        model = str(document.get("model") or self.models[0])
        streamed = bool(document.get("stream"))
        tokens = prompt_tokens(document)
        if tokens > self.context:
            self.too_long += 1
            status, error = self.context_error(tokens)
            await _json(io, request, error, status)
            return
        await self.before_slot(io, model)
        if streamed and self.stream_head_first:
            await io.send(sse_head())
        await self._take_slot(io)
        try:  # the slot is this request's until it ends, however it ends
            words = [f"word{i} " for i in range(self.tokens)]
            if not streamed:
                await io.pause(self.token_delay * self.tokens)
                answer = chat_completion(model, "".join(words), tokens, self.tokens)
                await _json(io, request, answer)
            else:
                if not self.stream_head_first:
                    await io.send(sse_head())
                for word in words:
                    await io.pause(self.token_delay)
                    if self.cut_short():  # "[DONE]", no finish_reason: looks complete
                        await io.send(h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())
                        self.interrupted += 1
                        return
                    await io.send(h11.Data(data=_event(chat_chunk(model, {"content": word}))))
                end = self.stream_end(model, tokens, include_usage(document))
                await io.send(h11.Data(data=end + b"data: [DONE]\n\n"), h11.EndOfMessage())
            self.served.append(model)
        finally:
            self._free_slot()

    def stream_end(self, model: str, prompt: int, include_usage: bool) -> bytes:
        """The events that end a stream before ``[DONE]``: the finish, and its usage if asked.

        vLLM's and Ollama's ``/v1`` shape: a ``usage`` event with no
        choices, only with ``stream_options.include_usage``.
        """
        end = _event(chat_chunk(model, {}, "stop"))
        return end + usage_event(model, prompt, self.tokens) if include_usage else end

    def _free_slot(self) -> None:
        self.in_use -= 1
        self._freed.unpark()

    async def _take_slot(self, io: NodeIO) -> None:
        """Wait for a free slot, noticing the proxy closing the connection meanwhile.

        Raises:
            trio.BrokenResourceError: the proxy closed the connection first.
        """
        taken = False
        self.deferred += 1
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await io.wait_closed()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                while self.in_use + self.other_clients >= self.slots:
                    await self._freed.park()
                self.in_use += 1
                taken = True
                nursery.cancel_scope.cancel()
        finally:
            self.deferred -= 1
        if not taken:
            raise trio.BrokenResourceError("the proxy closed the connection")


def _event(document: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(document).encode() + b"\n\n"


# -- llama-server -------------------------------------------------------------


class FakeLlamaServer(FakeEngine):
    """llama-server with ``--parallel slots``: ``/props``, ``/slots``, ``/health``, ``/metrics``.

    ``/slots`` lists one entry per slot, the first ``busy`` of them
    processing. A request past the slots waits, silent, with no head, until
    a slot frees: so the llama-server recorded in tests/data/engines/ does
    (``deferral`` in its answers.json). ``stream_head_first=True`` sends a
    streamed request's SSE head at once instead, as issue 30 describes
    llama-server, for tests of a proxy that must cope with either.
    """

    def __init__(
        self,
        *,
        slots: int = 1,
        model: str = "tiny",
        stream_head_first: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            slots=slots, models=(model,), stream_head_first=stream_head_first, **kwargs
        )

    def routes(self) -> dict[tuple[bytes, bytes], Route]:
        return {
            (b"GET", b"/props"): lambda io, r: _json(io, r, self.props()),
            (b"GET", b"/slots"): lambda io, r: _json(io, r, self.slot_list()),
            (b"GET", b"/health"): lambda io, r: _json(io, r, {"status": "ok"}),
            (b"GET", b"/metrics"): self._metrics,
        }

    def stream_end(self, model: str, prompt: int, include_usage: bool) -> bytes:
        """As recorded (tests/data/usage): ``timings`` in the finish event.

        With ``include_usage``, a last event with ``usage`` and ``timings`` too.
        """
        timings = {"cache_n": 0, "prompt_n": prompt, "predicted_n": self.tokens}
        end = _event({**chat_chunk(model, {}, "stop"), "timings": timings})
        if include_usage:
            end += _event({**usage_chunk(model, prompt, self.tokens), "timings": timings})
        return end

    def props(self) -> dict[str, Any]:
        """The ``GET /props`` document (the fields the proxy and its tests read)."""
        return {
            "default_generation_settings": {"n_ctx": 4096, "params": {"n_predict": -1}},
            "total_slots": self.slots,
            "model_alias": self.models[0],
            "model_path": f"/models/{self.models[0]}.gguf",
            "endpoint_slots": True,
            "endpoint_metrics": True,
            "build_info": "b0-fake",
            "is_sleeping": False,
        }

    def context_error(self, prompt_tokens: int) -> tuple[int, dict[str, Any]]:
        """llama-server's answer, as recorded (tests/data/engines/llama-server/)."""
        error = {
            "code": 400,
            "message": f"request ({prompt_tokens} tokens) exceeds the available context size"
            f" ({self.context} tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": prompt_tokens,
            "n_ctx": self.context,
        }
        return 400, {"error": error}

    def slot_list(self) -> list[dict[str, Any]]:
        """The ``GET /slots`` document."""
        return [
            {"id": index, "n_ctx": 4096, "speculative": False, "is_processing": index < self.busy}
            for index in range(self.slots)
        ]

    async def _metrics(self, io: NodeIO, request: ReceivedRequest) -> None:
        text = (
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {self.busy}\n"
            "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
            "# TYPE llamacpp:requests_deferred gauge\n"
            f"llamacpp:requests_deferred {self.deferred}\n"
        )
        headers = (("content-type", "text/plain; version=0.0.4"),)
        await healthy(text.encode(), headers=headers)(io, request)


# -- llama-cpp-python ---------------------------------------------------------

LLAMA_CPP_PYTHON_TITLE = "\U0001f999 llama.cpp Python API"  # its FastAPI app's title


class FakeLlamaCppPython(FakeEngine):
    """llama-cpp-python's server: its model's one lock, and what a second request does to a stream.

    A completion, and ``GET /v1/models``, take the lock (its one slot);
    with ``interrupt_requests`` (the engine's default) a stream that runs
    while another request waits for the lock ends before its next token
    with ``data: [DONE]`` and no ``finish_reason``: a complete-looking
    answer (``interrupted`` counts them). Without it the other request
    waits. A streamed request gets its SSE head at once. ``GET /v1/models``
    lists its models ``owned_by`` "me" with ``permissions``, ``GET
    /openapi.json`` names its app; ``GET /health`` and any other route it
    lacks answer ``404 {"detail": "Not Found"}`` at once, without the lock.
    """

    def __init__(
        self, *, model: str = "tiny", interrupt_requests: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(slots=1, models=(model,), stream_head_first=True, **kwargs)
        self.interrupt_requests = interrupt_requests

    def routes(self) -> dict[tuple[bytes, bytes], Route]:
        return {
            (b"GET", b"/v1/models"): self._models,
            (b"GET", b"/openapi.json"): lambda io, r: _json(io, r, self.openapi()),
        }

    async def __call__(self, io: NodeIO, request: ReceivedRequest) -> None:
        path = request.target.partition(b"?")[0]
        known = (request.method, path) in self.routes() or (
            request.method == b"POST" and path.endswith(b"/completions")
        )
        if not known:
            await _json(io, request, {"detail": "Not Found"}, 404)
            return
        await super().__call__(io, request)

    def model_list(self) -> dict[str, Any]:
        data = [
            {"id": model, "object": "model", "owned_by": "me", "permissions": []}
            for model in self.models
        ]
        return {"object": "list", "data": data}

    def openapi(self) -> dict[str, Any]:
        """The head of its ``GET /openapi.json`` (as recorded in tests/data/engines/)."""
        return {"openapi": "3.1.0", "info": {"title": LLAMA_CPP_PYTHON_TITLE, "version": "0.3.36"}}

    def cut_short(self) -> bool:
        return self.interrupt_requests and self.deferred > 0

    def stream_end(self, model: str, prompt: int, include_usage: bool) -> bytes:
        """As recorded (tests/data/usage): no tokens in its streams, ``include_usage`` or not."""
        return _event(chat_chunk(model, {}, "stop"))

    async def _models(self, io: NodeIO, request: ReceivedRequest) -> None:
        await self._take_slot(io)  # Depends(get_llama_proxy): the model's lock
        try:
            await _json(io, request, self.model_list())
        finally:
            self._free_slot()


# -- vLLM ---------------------------------------------------------------------


class FakeVllm(FakeEngine):
    """vLLM with ``--max-num-seqs slots``: ``GET /metrics`` from its own queue.

    Running requests are those in a slot, waiting those deferred; the KV
    cache fills with the running share. ``/health`` answers 200, empty.
    """

    def __init__(self, *, slots: int = 4, model: str = "fake-model", **kwargs: Any) -> None:
        super().__init__(slots=slots, models=(model,), **kwargs)

    def routes(self) -> dict[tuple[bytes, bytes], Route]:
        return {
            (b"GET", b"/metrics"): self._metrics,
            (b"GET", b"/health"): healthy(b"", headers=()),
        }

    def context_error(self, prompt_tokens: int) -> tuple[int, dict[str, Any]]:
        """vLLM's answer, from its source (tests/data/engines/vllm/context-exceeded.json)."""
        error = {
            "message": f"This model's maximum context length is {self.context} tokens. However,"
            f" your request has {prompt_tokens} input tokens. Please reduce the length of the"
            " input messages.",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
        return 400, {"error": error}

    def metrics_text(self) -> str:
        """The ``GET /metrics`` text (the three series the proxy reads)."""
        labels = f'engine="0",model_name="{self.models[0]}"'
        gauges = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                self.busy,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                self.deferred,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                self.busy / max(self.slots, 1) / 2,
            ),
        ]
        lines = []
        for name, help_text, value in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            lines.append(f"{name}{{{labels}}} {float(value)}")
        return "\n".join(lines) + "\n"

    async def _metrics(self, io: NodeIO, request: ReceivedRequest) -> None:
        headers = (("content-type", "text/plain; version=0.0.4; charset=utf-8"),)
        await healthy(self.metrics_text().encode(), headers=headers)(io, request)


# -- engines that load models on demand ---------------------------------------


class _LoadingEngine(FakeEngine):
    """An engine that loads a model on the first request for it (Ollama, LM Studio).

    Attributes:
        loaded: the models loaded now, in load order.
        loads: every cold load, by model, in order.
    """

    def __init__(
        self,
        *,
        models: Sequence[str],
        loaded: Sequence[str] = (),
        load_delay: float = 20.0,
        slots: int = 4,
        **kwargs: Any,
    ) -> None:
        super().__init__(slots=slots, models=models, stream_head_first=False, **kwargs)
        self.loaded = list(loaded)
        self.load_delay = load_delay
        self.loads: list[str] = []
        self._loading: dict[str, trio.Event] = {}

    def is_loaded(self, model: str) -> bool:
        return any(same_model(model, name) for name in self.loaded)

    def unload(self, model: str) -> None:
        """Unload ``model`` (its keep-alive ran out)."""
        self.loaded = [name for name in self.loaded if not same_model(model, name)]

    async def before_slot(self, io: NodeIO, model: str) -> None:
        # Silent while loading: no head before the model is in memory. Two
        # requests for a model share its one load.
        if self.is_loaded(model):
            return
        key = next((m for m in self.models if same_model(model, m)), model)
        loading = self._loading.get(key)
        if loading is None:
            loading = self._loading[key] = trio.Event()
            self.loads.append(key)
            try:
                await io.pause(self.load_delay)
            finally:
                # A load, once begun, completes even if its requester left.
                self.loaded.append(key)
                del self._loading[key]
                loading.set()
        else:
            await loading.wait()


class FakeOllama(_LoadingEngine):
    """Ollama: ``/api/version``, ``/api/tags``, ``/api/ps``; a cold load of ``load_delay``.

    A request for a model it does not have gets Ollama's 404 ``model ...
    not found``.
    """

    def __init__(self, *, models: Sequence[str] = ("fake-model:latest",), **kwargs: Any) -> None:
        super().__init__(models=models, **kwargs)

    def routes(self) -> dict[tuple[bytes, bytes], Route]:
        return {
            (b"GET", b"/api/version"): lambda io, r: _json(io, r, {"version": "0.12.3"}),
            (b"GET", b"/api/tags"): lambda io, r: _json(io, r, self.tags()),
            (b"GET", b"/api/ps"): lambda io, r: _json(io, r, self.ps()),
            (b"GET", b"/"): healthy(
                b"Ollama is running", headers=(("content-type", "text/plain"),)
            ),
        }

    def tags(self) -> dict[str, Any]:
        return {"models": [_ollama_entry(model) for model in self.models]}

    def ps(self) -> dict[str, Any]:
        entries = []
        for model in self.loaded:
            entry = _ollama_entry(model)
            entry.pop("modified_at")
            entry.update(expires_at="2030-01-01T00:05:00Z", size_vram=1 << 30, context_length=4096)
            entries.append(entry)
        return {"models": entries}

    async def complete(self, io: NodeIO, request: ReceivedRequest) -> None:
        model = str((request.json() if request.body else {}).get("model", ""))
        if not any(same_model(model, known) for known in self.models):
            error = {"error": f'model "{model}" not found, try pulling it first'}
            await _json(io, request, error, 404)
            return
        await super().complete(io, request)


def _ollama_entry(model: str) -> dict[str, Any]:
    details = {"format": "gguf", "family": "llama", "parameter_size": "1B"}
    return {
        "name": model,
        "model": model,
        "modified_at": "2025-05-30T10:12:07Z",
        "size": 1 << 30,
        "digest": "0" * 64,
        "details": details,
    }


class FakeLmStudio(_LoadingEngine):
    """LM Studio: ``GET /api/v0/models`` with ``state`` per model; JIT loading."""

    def __init__(self, *, models: Sequence[str] = ("fake-model",), **kwargs: Any) -> None:
        super().__init__(models=models, **kwargs)

    def routes(self) -> dict[tuple[bytes, bytes], Route]:
        return {(b"GET", b"/api/v0/models"): lambda io, r: _json(io, r, self.v0_models())}

    def v0_models(self) -> dict[str, Any]:
        data = [
            {
                "id": model,
                "object": "model",
                "type": "llm",
                "publisher": "fake",
                "arch": "llama",
                "compatibility_type": "gguf",
                "quantization": "Q4_K_M",
                "state": "loaded" if self.is_loaded(model) else "not-loaded",
                "max_context_length": 4096,
            }
            for model in self.models
        ]
        return {"object": "list", "data": data}
