"""Traces: the exact span tree of a workload, in virtual time.

The whole proxy over in-memory streams under ``MockClock`` (pytest-trio's
``autojump_clock``), its spans handed to the SDK's ``InMemorySpanExporter``
through a ``SimpleSpanProcessor``, and the wall clock replaced by a
constant: every span's start and end, and every event's time, is exact.
The export over the wire is ``test_tracing_export.py``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import attrs
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from test_shutdown import drained, streaming

from trio_failover import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.telemetry.tracing import Tracing
from trio_failover.testing import (
    FakeNode,
    Fleet,
    frozen,
    healthy,
    openai,
    request,
    retry_status,
    slow_prefill_with_pings,
)

# The wall clock at the first span: Trio's time 0 is this epoch nanosecond.
EPOCH = 1_764_633_600_000_000_000
STREAMED = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def at(seconds: float) -> int:
    """The span timestamp of Trio time ``seconds``."""
    return EPOCH + round(seconds * 1e9)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    yield memory
    memory.shutdown()


def traced(fleet: Fleet, exporter: InMemorySpanExporter, **settings: object) -> Proxy:
    """A proxy whose spans go to ``exporter``, one at a time, as each ends."""
    upstreams = settings.pop("upstreams", fleet.upstreams())
    settings.setdefault("liveness_interval", 0)  # the spans of the deadlines alone
    config = Config(upstreams=upstreams, admin_listen=None, **settings)  # type: ignore[arg-type]
    return trace_to(Proxy(config, connector=fleet.connector), exporter)


def trace_to(proxy: Proxy, exporter: InMemorySpanExporter) -> Proxy:
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    proxy.report.tracing = Tracing(provider, clock=lambda: EPOCH)
    return proxy


def tree(exporter: InMemorySpanExporter) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The one workload span and its attempt spans, in the order they started."""
    spans = exporter.get_finished_spans()
    roots = [span for span in spans if span.kind is SpanKind.SERVER]
    assert len(roots) == 1, spans
    root = roots[0]
    assert root.context is not None
    children = [span for span in spans if span is not root]
    for child in children:
        assert child.kind is SpanKind.CLIENT
        assert child.parent is not None
        assert child.parent.span_id == root.context.span_id
        assert child.context is not None
        assert child.context.trace_id == root.context.trace_id
    return root, sorted(children, key=lambda span: span.start_time or 0)


def events(span: ReadableSpan) -> list[tuple[str, int, dict[str, object]]]:
    return [(event.name, event.timestamp, dict(event.attributes or {})) for event in span.events]


async def test_a_failover_is_one_workload_span_with_two_attempt_spans(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    nodes = {
        "a": FakeNode(healthy(b'{"error": "busy"}', status=503, head_delay=1.0)),
        "b": FakeNode(healthy(b'{"ok": true}', head_delay=2.0)),
    }
    async with Fleet(nodes) as fleet:
        proxy = traced(fleet, exporter)
        response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.status == 200

    root, (first, second) = tree(exporter)
    assert root.name == "POST /v1/chat/completions"
    assert root.parent is None  # no traceparent from the client: a new trace
    assert (root.start_time, root.end_time) == (at(0), at(3))
    assert root.status.status_code is StatusCode.UNSET
    attributes = dict(root.attributes or {})
    workload_id = attributes.pop("trio_failover.workload_id")
    assert attributes == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "url.scheme": "http",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m",
        "http.response.status_code": 200,
        "trio_failover.outcome": "completed",
        "trio_failover.node": "b",
        "trio_failover.attempts": 2,
        "trio_failover.queued_ms": 0.0,
        "trio_failover.client": "anonymous",
    }
    assert response.header("x-request-id") == workload_id
    assert events(root) == []

    assert first.name == "attempt a"
    assert (first.start_time, first.end_time) == (at(0), at(1))
    assert first.status.status_code is StatusCode.ERROR
    assert first.status.description == "a: head: answered 503"
    assert dict(first.attributes or {}) == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "server.address": "a.invalid",
        "server.port": 80,
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m",
        "trio_failover.node": "a",
        "trio_failover.attempt": 1,
        "trio_failover.workload_id": workload_id,
        "trio_failover.outcome": "retryable_response",
        "trio_failover.elapsed_ms": 1000.0,
        "http.response.status_code": 503,
        "error.type": "retryable_response",
    }
    assert events(first) == []

    assert second.name == "attempt b"
    assert (second.start_time, second.end_time) == (at(1), at(3))
    assert second.status.status_code is StatusCode.UNSET
    assert dict(second.attributes or {})["trio_failover.outcome"] == "completed"
    assert dict(second.attributes or {})["trio_failover.attempt"] == 2
    assert dict(second.attributes or {})["trio_failover.elapsed_ms"] == 2000.0
    assert dict(second.attributes or {})["http.response.status_code"] == 200
    assert "error.type" not in dict(second.attributes or {})
    # A JSON body's first byte is its first token: both at the commit.
    assert events(second) == [
        ("commit", at(3), {"http.response.status_code": 200}),
        ("first_token", at(3), {}),
    ]


async def test_traceparent_is_continued_and_each_node_gets_its_attempt_s(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode(retry_status(503)), "b": FakeNode(healthy())}) as fleet:
        proxy = traced(fleet, exporter)
        headers = [
            ("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),
            ("tracestate", "congo=t61rcWkgMzE"),
        ]
        response = await request(proxy, body=STREAMED, headers=headers)
        assert response is not None
        assert response.status == 200

    root, attempts = tree(exporter)
    assert root.context is not None
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert root.parent.is_remote
    for name, span in zip("ab", attempts, strict=True):
        (received,) = fleet[name].received
        assert span.context is not None
        sent = [value for key, value in received.headers if key in (b"traceparent", b"tracestate")]
        # The node's parent is the attempt, in the client's trace; one of each, never doubled.
        assert sent == [
            f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01".encode(),
            b"congo=t61rcWkgMzE",
        ]


async def test_a_trace_the_client_did_not_sample_is_not_recorded_but_passed_on(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    # The default sampler follows the parent: flags 00 record nothing here,
    # and the node is told the same, so it records nothing either.
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = traced(fleet, exporter)
        headers = [("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00")]
        response = await request(proxy, body=STREAMED, headers=headers)
        assert response is not None
        assert response.status == 200
    assert exporter.get_finished_spans() == ()
    (received,) = fleet["a"].received
    sent = received.header("traceparent")
    assert sent is not None
    version, trace_id, parent, flags = sent.decode().split("-")
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "00")
    assert parent != CLIENT_SPAN  # the attempt's own span id, though unrecorded


async def test_a_new_trace_sends_the_node_a_traceparent_too(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        proxy = traced(fleet, exporter)
        await request(proxy, body=STREAMED)
    root, (attempt,) = tree(exporter)
    assert root.context is not None
    assert attempt.context is not None
    (received,) = fleet["a"].received
    context = attempt.context
    # The flags as the SDK makes them: sampled, and (W3C level 2) a random trace id.
    parent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert received.header("traceparent") == parent.encode()
    assert received.header("tracestate") is None


async def test_a_queued_workload_has_its_wait_on_its_span(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode(healthy(head_delay=5.0))}) as fleet:
        (node,) = fleet.upstreams()
        proxy = traced(fleet, exporter, upstreams=[attrs.evolve(node, capacity=1)])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, proxy)
            await trio.sleep(1.0)  # the first holds the one slot until 5
            await request(proxy)

    later = [s for s in exporter.get_finished_spans() if s.start_time == at(1)]
    (waiting,) = [span for span in later if span.kind is SpanKind.SERVER]
    assert (waiting.start_time, waiting.end_time) == (at(1), at(10))
    assert events(waiting) == [("queue_wait", at(1), {"trio_failover.wait_ms": 4000.0})]
    assert dict(waiting.attributes or {})["trio_failover.queued_ms"] == 4000.0
    assert waiting.context is not None
    (attempt,) = [
        span
        for span in exporter.get_finished_spans()
        if span.parent is not None and span.parent.span_id == waiting.context.span_id
    ]
    assert (attempt.start_time, attempt.end_time) == (at(5), at(10))


async def test_a_client_that_leaves_ends_its_span_cancelled(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode(frozen())}) as fleet:
        proxy = traced(fleet, exporter)
        # request() returns once the proxy is done with the connection.
        assert await request(proxy, body=STREAMED, leave_after=30.0) is None

    root, (attempt,) = tree(exporter)
    assert root.end_time == at(30)
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "cancelled"
    assert dict(root.attributes or {})["trio_failover.outcome"] == "cancelled"
    assert dict(root.attributes or {})["error.type"] == "cancelled"
    assert dict(root.attributes or {})["trio_failover.reason"] == "client_abort"
    assert "http.response.status_code" not in dict(root.attributes or {})
    assert attempt.end_time == at(30)
    assert attempt.status.status_code is StatusCode.ERROR
    assert dict(attempt.attributes or {})["trio_failover.outcome"] == "client_abort"


async def test_a_stream_cut_at_the_end_of_a_drain_ends_its_span_with_reason_shutdown(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    # As in test_shutdown: a chunk every 10 s for 60 s; the drain begins at
    # t=12 with 5 s, and cuts the stream at t=17.
    async with Fleet({"a": streaming(60.0)}) as fleet:
        proxy = traced(fleet, exporter)
        response, _ = await drained(proxy, STREAMED, drain_at=12.0, shutdown_timeout=5.0)
    assert (response.status, response.complete) == (200, False)

    root, (attempt,) = tree(exporter)
    assert root.end_time == at(17)
    assert root.status.status_code is StatusCode.ERROR
    attributes = dict(root.attributes or {})
    assert attributes["trio_failover.outcome"] == "cancelled"
    assert attributes["trio_failover.reason"] == "shutdown"
    assert attributes["http.response.status_code"] == 200
    assert dict(attempt.attributes or {})["trio_failover.outcome"] == "shutdown"
    assert attempt.end_time == at(17)


async def test_a_workload_that_completes_has_no_reason_on_its_span(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = traced(fleet, exporter)
        response = await request(proxy, body=STREAMED)
        assert response is not None
    root, _ = tree(exporter)
    assert "trio_failover.reason" not in dict(root.attributes or {})


async def test_the_first_token_of_a_stream_after_pings_is_its_first_event(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    # Without --first-body-timeout the first ping (at 15 s) commits; the
    # first token is the first event line, at the end of the 40 s prefill.
    async with Fleet({"a": FakeNode(slow_prefill_with_pings(40.0))}) as fleet:
        proxy = traced(fleet, exporter)
        response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.complete

    _, (attempt,) = tree(exporter)
    assert events(attempt) == [
        ("commit", at(15), {"http.response.status_code": 200}),
        ("first_token", at(40), {}),
    ]


async def test_a_streamed_answer_has_one_first_token(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode(openai(tokens=3, token_delay=0.5))}) as fleet:
        proxy = traced(fleet, exporter)
        response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.complete

    root, (attempt,) = tree(exporter)
    assert [name for name, _, _ in events(attempt)] == ["commit", "first_token"]
    assert attempt.end_time == root.end_time == at(2.0)  # 3 tokens, a stop and [DONE]
    # No usage in the stream: estimated, an event each for 3 tokens and the stop.
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.usage.output_tokens"] == 4
    assert attributes["gen_ai.usage.input_tokens"] == -(-len(STREAMED) // 4)


async def test_every_node_failing_is_an_error_of_its_status(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode(frozen())}) as fleet:
        proxy = traced(fleet, exporter)
        response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.status == 504

    root, (attempt,) = tree(exporter)
    assert (root.end_time, attempt.end_time) == (at(120), at(120))
    assert root.status.status_code is StatusCode.ERROR
    assert dict(root.attributes or {})["error.type"] == "504"
    assert dict(root.attributes or {})["trio_failover.outcome"] == "failed"
    assert dict(attempt.attributes or {})["error.type"] == "header_timeout"


async def test_an_attempt_s_span_has_the_node_s_path_and_model_name(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        node = Upstream("a", "http://a.invalid:8000/engine", models={"m": "org/model-7b"})
        proxy = traced(fleet, exporter, upstreams=[node])
        await request(proxy, body=STREAMED)

    root, (attempt,) = tree(exporter)
    attributes = dict(attempt.attributes or {})
    assert attributes["url.path"] == "/engine/v1/chat/completions"
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "org/model-7b"
    assert (attributes["server.address"], attributes["server.port"]) == ("a.invalid", 8000)
    assert dict(root.attributes or {})["gen_ai.request.model"] == "m"


class BrokenConnector:
    """A connector with a bug: what no attempt milestone records."""

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        await trio.sleep(2.0)
        raise RuntimeError("a bug")


async def test_an_internal_error_still_ends_the_attempt_s_span(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    config = Config(
        upstreams=[Upstream("a", "http://a.invalid")], admin_listen=None, discovery_interval=0
    )
    async with trace_to(Proxy(config, connector=BrokenConnector()), exporter) as proxy:
        response = await request(proxy, body=STREAMED)
    assert response is not None
    assert response.status == 502

    root, (attempt,) = tree(exporter)
    assert (attempt.end_time, root.end_time) == (at(2), at(2))
    assert attempt.status.status_code is StatusCode.ERROR
    assert dict(attempt.attributes or {})["trio_failover.outcome"] == "cancelled"
    assert dict(root.attributes or {})["error.type"] == "502"


async def test_the_wall_clock_is_read_once_at_the_first_span(
    autojump_clock: trio.abc.Clock, exporter: InMemorySpanExporter
) -> None:
    readings = iter([EPOCH])  # a second reading would raise StopIteration
    async with Fleet({"a": FakeNode(healthy(head_delay=1.0))}) as fleet:
        proxy = traced(fleet, exporter)
        assert proxy.report.tracing is not None
        proxy.report.tracing = Tracing(proxy.report.tracing.provider, clock=lambda: next(readings))
        await trio.sleep(100.0)
        await request(proxy)  # Trio time 100: the wall clock then read EPOCH
        await trio.sleep(59.0)
        await request(proxy)  # 60 s later by Trio's clock

    workloads = [span for span in exporter.get_finished_spans() if span.kind is SpanKind.SERVER]
    assert [(span.start_time, span.end_time) for span in workloads] == [
        (EPOCH, EPOCH + 1_000_000_000),
        (EPOCH + 60_000_000_000, EPOCH + 61_000_000_000),
    ]


def test_the_option_batches_spans_to_the_collector() -> None:
    node = Upstream("a", "http://127.0.0.1:9")
    config = Config(upstreams=[node], otel_endpoint="http://127.0.0.1:9/")
    tracing = Proxy(config).report.tracing
    assert tracing is not None
    try:
        processors = tracing.provider._active_span_processor._span_processors  # type: ignore[attr-defined]
        (processor,) = processors
        # Exported by the processor's own thread, never on the request path.
        assert isinstance(processor, BatchSpanProcessor)
        exporter = processor.span_exporter
        assert exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    finally:
        tracing.shutdown()


def test_without_the_option_nothing_of_opentelemetry_is_imported() -> None:
    # A fresh interpreter: this one has imported the SDK for the tests above.
    script = textwrap.dedent(
        """
        import sys
        import trio
        from trio_failover import Config, Upstream
        from trio_failover.proxy import Proxy
        from trio_failover.testing import FakeNode, Fleet, healthy, request

        async def main():
            async with Fleet({"a": FakeNode(healthy())}) as fleet:
                config = Config(upstreams=fleet.upstreams(), admin_listen=None)
                proxy = Proxy(config, connector=fleet.connector)
                response = await request(proxy, body=b'{"model": "m"}')
                assert response.status == 200, response
                assert proxy.report.tracing is None

        trio.run(main)
        print(sorted(name for name in sys.modules if name.startswith("opentelemetry")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
