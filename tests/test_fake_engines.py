"""The fake engines of the test kit answer as the real ones do (docs/engines.md).

Their signal reads are checked against the recorded and documented answers
in tests/data/engines/ (same fields, parsed by the same parsers), and their
slots and cold loads under the autojump clock, at exact virtual times.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trio.testing

from trio_failover.core.engine_parsers import (
    llama_props,
    llama_slots,
    lmstudio_models,
    next_detection,
    ollama_ps,
)
from trio_failover.core.engines import DETECTION_PATHS, Answer, Ask, Detection, EngineKind, Signals
from trio_failover.core.inventory import is_model_not_found, parse_model_list
from trio_failover.core.outcome import error_names
from trio_failover.testing import (
    FakeEngine,
    FakeLlamaCppPython,
    FakeLlamaServer,
    FakeLmStudio,
    FakeNode,
    FakeOllama,
    FakeVllm,
    openai,
    request_node,
)
from trio_failover.wire.engine_metrics import vllm_metrics
from trio_failover.wire.http1 import send_events

DATA = Path(__file__).resolve().parent / "data" / "engines"
LIMIT = 600.0  # virtual seconds any test here may take
STREAMED = b'{"model": "%s", "stream": true}'
ASKED = ["/props", "/api/version", "/metrics", "/api/v0/models", "/openapi.json"]


async def get(node: FakeNode, path: str) -> Answer:
    response = await request_node(node, "GET", path)
    assert response is not None
    return Answer(response.status, response.header("content-type") or "", response.body)


async def get_json(node: FakeNode, path: str) -> Any:
    return json.loads((await get(node, path)).body)


def recorded(name: str) -> Any:
    return json.loads((DATA / name).read_bytes())


class Stream:
    """A streamed completion sent straight to a fake, with the time of its head and chunks."""

    def __init__(self) -> None:
        self.head_at: float | None = None
        self.chunks: list[float] = []
        self.done = trio.Event()

    async def run(self, node: FakeNode, model: str, leave_after: float | None = None) -> None:
        client, server = trio.testing.memory_stream_pair()
        conn = h11.Connection(h11.CLIENT)
        body = STREAMED % model.encode()
        head = [(b"host", b"x"), (b"content-length", b"%d" % len(body))]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.serve_connection, server)
            request = h11.Request(method="POST", target="/v1/chat/completions", headers=head)
            await send_events(client, conn, request, h11.Data(data=body), h11.EndOfMessage())
            with trio.move_on_after(LIMIT if leave_after is None else leave_after):
                await self._read(client, conn)
            await client.aclose()
        self.done.set()

    async def _read(self, client: trio.abc.Stream, conn: h11.Connection) -> None:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await client.receive_some(65536))
            elif isinstance(event, h11.Response):
                self.head_at = trio.current_time()
            elif isinstance(event, h11.Data):
                self.chunks.append(trio.current_time())
            elif isinstance(event, h11.EndOfMessage):
                return


# -- answers as recorded ----------------------------------------------------------------


async def test_fake_llama_server_props_and_slots_have_the_recorded_fields() -> None:
    node = FakeNode(FakeLlamaServer(slots=2))
    props = await get_json(node, "/props")
    assert set(props) <= set(recorded("llama-server/props.json"))
    slot_fields = set(recorded("llama-server/slots-idle.json")[0])
    assert all(set(slot) <= slot_fields for slot in await get_json(node, "/slots"))
    assert llama_props(await get(node, "/props")) == Signals(total_slots=2)
    assert llama_slots(await get(node, "/slots")) == Signals(busy=0)
    assert await get_json(node, "/health") == recorded("llama-server/health.json")
    listing = parse_model_list((await get(node, "/v1/models")).body)
    assert listing.ids == ("tiny",)


def long_chat(words: int, stream: bool = False) -> bytes:
    content = " ".join(["w"] * words)
    return json.dumps(
        {"model": "tiny", "stream": stream, "messages": [{"content": content}]}
    ).encode()


@pytest.mark.parametrize(
    ("engine", "answer"),
    [
        (FakeLlamaServer, "llama-server/context-exceeded.json"),
        (FakeLlamaCppPython, "llama-cpp-python/context-exceeded.json"),
        (FakeVllm, "vllm/context-exceeded.json"),
    ],
    ids=lambda value: value if isinstance(value, str) else value.__name__,
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_over_a_fakes_context_gets_its_engines_400(
    engine: type[FakeEngine], answer: str, stream: bool
) -> None:
    fake = engine(context=10)
    node = FakeNode(fake)
    fits = await request_node(node, "POST", "/v1/chat/completions", body=long_chat(10, stream))
    over = await request_node(node, "POST", "/v1/chat/completions", body=long_chat(11, stream))
    assert fits is not None
    assert over is not None
    assert (fits.status, over.status) == (200, 400)
    engine = recorded(answer)
    body = json.loads(over.body)
    assert set(body) == set(engine)
    assert set(body["error"]) == set(engine["error"])
    assert error_names(over.body) == error_names(json.dumps(engine).encode())
    assert fake.too_long == 1


async def test_fake_llama_cpp_python_answers_have_the_recorded_fields() -> None:
    node = FakeNode(FakeLlamaCppPython())
    models = await get_json(node, "/v1/models")
    assert set(models["data"][0]) == set(recorded("llama-cpp-python/v1-models.json")["data"][0])
    title = recorded("llama-cpp-python/openapi.json")["info"]["title"]
    assert (await get_json(node, "/openapi.json"))["info"]["title"] == title
    for path in ("/health", "/props", "/api/tags"):
        answer = await get(node, path)
        assert answer.status == 404
        assert json.loads(answer.body) == recorded("llama-cpp-python/health.json")


async def test_fake_llama_cpp_python_ends_a_stream_for_a_waiting_request(
    autojump_clock: Any,
) -> None:
    fake = FakeLlamaCppPython(tokens=10, token_delay=1.0)
    node = FakeNode(fake)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            first = Stream()
            nursery.start_soon(first.run, node, "tiny")
            await trio.sleep(2.5)  # two tokens out
            listing = await get(node, "/v1/models")  # takes the lock: the stream ends
    assert listing.status == 200
    assert trio.current_time() == 3.0
    assert first.chunks == [1.0, 2.0, 3.0]  # two tokens, then "[DONE]" with no finish_reason
    assert (fake.interrupted, fake.served) == (1, [])


async def test_fake_llama_cpp_python_without_interruptions_makes_the_next_wait(
    autojump_clock: Any,
) -> None:
    fake = FakeLlamaCppPython(tokens=3, token_delay=1.0, interrupt_requests=False)
    node = FakeNode(fake)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Stream().run, node, "tiny")
            await trio.sleep(0.5)
            await get(node, "/v1/models")
    assert trio.current_time() == 3.0
    assert (fake.interrupted, fake.served) == (0, ["tiny"])


async def test_fake_ollama_answers_have_the_documented_fields() -> None:
    fake = FakeOllama(models=("m:latest", "n:latest"), loaded=("m:latest",))
    node = FakeNode(fake)
    ps_entry = (await get_json(node, "/api/ps"))["models"][0]
    assert set(ps_entry) == set(recorded("ollama/ps.json")["models"][0])
    tags_entry = (await get_json(node, "/api/tags"))["models"][0]
    assert set(tags_entry) == set(recorded("ollama/tags.json")["models"][0])
    assert set(await get_json(node, "/api/version")) == set(recorded("ollama/version.json"))
    signals = ollama_ps(await get(node, "/api/ps"))
    assert signals.loaded == frozenset({"m:latest"})
    assert signals.loaded_is_complete


async def test_fake_lmstudio_answers_have_the_documented_fields() -> None:
    node = FakeNode(FakeLmStudio(models=("a", "b"), loaded=("b",)))
    entry = (await get_json(node, "/api/v0/models"))["data"][0]
    assert set(entry) == set(recorded("lmstudio/models.json")["data"][0])
    signals = lmstudio_models(await get(node, "/api/v0/models"))
    assert (signals.loaded, signals.not_loaded) == (frozenset({"b"}), frozenset({"a"}))


async def test_fake_vllm_metrics_parse_as_the_documented_ones() -> None:
    node = FakeNode(FakeVllm(slots=4, model="q"))
    answer = await get(node, "/metrics")
    assert answer.content_type.startswith("text/plain; version=0.0.4")
    assert vllm_metrics(answer).busy == 0
    assert (await get(node, "/health")).status == 200


@pytest.mark.parametrize(
    ("fake", "listed", "kind", "asked"),
    [
        (FakeLlamaServer(), True, EngineKind.LLAMA_SERVER, ["/props"]),
        (FakeLlamaCppPython(), True, EngineKind.LLAMA_CPP_PYTHON, []),
        (FakeLlamaCppPython(), False, EngineKind.LLAMA_CPP_PYTHON, ASKED),
        (FakeOllama(), True, EngineKind.OLLAMA, ["/props", "/api/version"]),
        (FakeVllm(), True, EngineKind.VLLM, ["/props", "/api/version", "/metrics"]),
        (FakeLmStudio(), True, EngineKind.LMSTUDIO, ASKED[:4]),
        (openai(), True, EngineKind.OPENAI, ASKED),
    ],
    ids=lambda value: value if isinstance(value, str) else type(value).__name__,
)
async def test_each_fake_is_detected_as_its_engine(
    fake: Any, listed: bool, kind: EngineKind, asked: list[str]
) -> None:
    """``listed``: the check had a ``/v1/models`` answer (no attempt in flight then)."""
    node = FakeNode(fake)
    answers: dict[str, Answer | None] = {}
    if listed:
        answers["/v1/models"] = await get(node, "/v1/models")
    questions = []
    for _ in DETECTION_PATHS:
        step = next_detection(answers)
        if not isinstance(step, Ask):
            break
        questions.append(step.path)
        answers[step.path] = await get(node, step.path)
    assert isinstance(step, Detection)
    assert (step.kind, questions) == (kind, asked)


# -- slots ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head_first", "heads"),
    [
        (False, [0.0, 0.0, 3.0]),  # as recorded: no head while deferred
        (True, [0.0, 0.0, 0.0]),  # as issue 30 describes it
    ],
)
async def test_llama_server_defers_past_its_slots(
    autojump_clock: Any, head_first: bool, heads: list[float]
) -> None:
    fake = FakeLlamaServer(slots=2, tokens=3, token_delay=1.0, stream_head_first=head_first)
    node = FakeNode(fake)
    streams = [Stream() for _ in range(3)]
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(stream.run, node, "tiny")
            await trio.sleep(0.5)
            assert (fake.busy, fake.deferred) == (2, 1)
            assert llama_slots(await get(node, "/slots")) == Signals(busy=2)
            slots = await get_json(node, "/slots")
            assert [slot["is_processing"] for slot in slots] == [True, True]
    # The third's first token only after a slot freed at 3.0.
    assert sorted(stream.head_at for stream in streams if stream.head_at is not None) == heads
    assert sorted(stream.chunks[0] for stream in streams) == [1.0, 1.0, 4.0]
    assert trio.current_time() == 6.0
    assert (fake.busy, fake.deferred, fake.served) == (0, 0, ["tiny"] * 3)


def test_the_fake_llama_server_defers_as_the_recorded_one() -> None:
    deferral = recorded("llama-server/answers.json")["deferral"]
    assert deferral["third_head_s_after_start_while_deferred"] is None
    assert (
        deferral["third_head_s_after_start"] > deferral["first_stream_told_to_leave_s_after_start"]
    )
    assert FakeLlamaServer().stream_head_first is False


async def test_other_clients_take_slots_the_proxy_cannot_see(autojump_clock: Any) -> None:
    fake = FakeLlamaServer(slots=2, tokens=1, token_delay=1.0)
    node = FakeNode(fake)
    fake.set_other_clients(2)
    stream = Stream()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.run, node, "tiny")
            await trio.sleep(5.0)
            assert llama_slots(await get(node, "/slots")) == Signals(busy=2)
            assert fake.deferred == 1
            fake.set_other_clients(1)
    assert stream.head_at == 5.0  # when another client's work left a slot
    assert stream.chunks[0] == 6.0


async def test_a_client_that_leaves_frees_its_place(autojump_clock: Any) -> None:
    fake = FakeLlamaServer(slots=1, tokens=10, token_delay=1.0)
    node = FakeNode(fake)
    running, waiting = Stream(), Stream()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(running.run, node, "tiny", 2.5)
            await trio.sleep(0.1)
            nursery.start_soon(waiting.run, node, "tiny", 1.0)
            await trio.sleep(0.5)
            assert (fake.busy, fake.deferred) == (1, 1)
            await trio.sleep(1.0)
            assert (fake.busy, fake.deferred) == (1, 0)  # the waiting one left at 1.1
            await trio.sleep(1.0)
            assert fake.busy == 0  # the running one left at 2.5
    assert waiting.done.is_set()
    assert (waiting.head_at, waiting.chunks) == (None, [])
    assert fake.served == []


async def test_vllm_metrics_count_running_and_waiting(autojump_clock: Any) -> None:
    fake = FakeVllm(slots=1, model="q", tokens=2, token_delay=1.0)
    node = FakeNode(fake)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(Stream().run, node, "q")
            await trio.sleep(0.5)
            signals = vllm_metrics(await get(node, "/metrics"))
            assert (signals.busy, signals.waiting, signals.kv_cache_usage) == (1, 2, 0.5)
            assert set(signals.per_model) == {"q"}


# -- cold loads -------------------------------------------------------------------------


async def test_ollama_loads_a_model_once_silently(autojump_clock: Any) -> None:
    fake = FakeOllama(models=("m:latest",), load_delay=20.0, tokens=1, token_delay=1.0)
    node = FakeNode(fake)
    first, second = Stream(), Stream()
    with trio.fail_after(LIMIT):
        assert ollama_ps(await get(node, "/api/ps")).loaded == frozenset()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first.run, node, "m")  # NAME is NAME:latest
            nursery.start_soon(second.run, node, "m:latest")
    # No head during the load; one load served both.
    assert (first.head_at, second.head_at) == (20.0, 20.0)
    assert fake.loads == ["m:latest"]
    assert ollama_ps(await get(node, "/api/ps")).loaded == frozenset({"m:latest"})
    later = Stream()
    with trio.fail_after(LIMIT):
        await later.run(node, "m")
    assert later.head_at == 21.0  # loaded: no second load


async def test_ollama_refuses_a_model_it_does_not_have() -> None:
    node = FakeNode(FakeOllama(models=("m:latest",)))
    response = await request_node(node, "POST", "/v1/chat/completions", body=b'{"model": "x"}')
    assert response is not None
    assert response.status == 404
    assert is_model_not_found(response.status, response.body)


async def test_lmstudio_loads_on_demand_and_reports_it(autojump_clock: Any) -> None:
    fake = FakeLmStudio(models=("a", "b"), loaded=("a",), load_delay=7.0, tokens=1)
    node = FakeNode(fake)
    stream = Stream()
    with trio.fail_after(LIMIT):
        await stream.run(node, "b")
        signals = lmstudio_models(await get(node, "/api/v0/models"))
    assert stream.head_at == 7.0
    assert signals.loaded == frozenset({"a", "b"})
    fake.unload("a")
    assert not fake.is_loaded("a")


async def test_an_unknown_route_is_a_404() -> None:
    response = await request_node(FakeNode(FakeEngine()), "GET", "/nope")
    assert response is not None
    assert response.status == 404


async def test_an_unstreamed_completion_waits_for_its_slot(autojump_clock: Any) -> None:
    fake = FakeLlamaServer(slots=1, tokens=2, token_delay=1.0)
    node = FakeNode(fake)
    times: list[float] = []

    async def ask() -> None:
        response = await request_node(node, "POST", "/v1/chat/completions", body=b"{}")
        assert response is not None
        assert response.json()["object"] == "chat.completion"
        times.append(trio.current_time())

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)
    assert times == [2.0, 4.0]
