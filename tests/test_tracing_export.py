"""Traces over the wire: ``trio-failover serve --otel-endpoint`` to a real receiver.

The proxy runs as the real command in a subprocess, in front of two fake
nodes on real sockets (``a`` answers 503, ``b`` streams), and exports to
``otlp_receiver.py``'s OTLP/HTTP receiver. The body it POSTs is decoded
with ``opentelemetry-proto``: the wire format is checked, not assumed.
Real sockets and a real clock, so no autojump; every wait is bounded.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys

import trio
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from otlp_receiver import attributes, otlp_receiver
from support import serve_process

from trio_failover.testing import FakeNode, Fleet, openai, request_tcp, retry_status

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
STREAMED = json.dumps({"model": "m", "stream": True, "messages": []}).encode()


async def test_a_failover_exported_over_otlp_http() -> None:
    with otlp_receiver() as receiver:
        async with Fleet({"a": FakeNode(retry_status(503)), "b": FakeNode(openai())}) as fleet:
            a = await fleet.serve_tcp("a")
            b = await fleet.serve_tcp("b")
            # No checks: a would be found down before the request, which must try it.
            options = (f"--upstream=a={a.url}", f"--upstream=b={b.url}", "--discovery-interval=0")
            async with serve_process(*options, f"--otel-endpoint={receiver.endpoint}") as proxy:
                with trio.fail_after(15):
                    response = await request_tcp(
                        proxy.address,
                        body=STREAMED,
                        headers=[("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")],
                    )
                assert response is not None
                assert response.status == 200
                assert response.complete
                # SIGTERM drains and exits; the SDK sends what is batched at exit.
                proxy.process.send_signal(signal.SIGTERM)
                with trio.fail_after(15):
                    assert await proxy.process.wait() == 0
            export = await trio.to_thread.run_sync(receiver.next_export, 15)

    assert export.path == "/v1/traces"
    assert export.content_type == "application/x-protobuf"
    assert export.resource()["service.name"] == "trio-failover"
    spans = {span.name: span for span in export.spans()}
    assert sorted(spans) == ["POST /v1/chat/completions", "attempt a", "attempt b"]
    root, first, second = (
        spans["POST /v1/chat/completions"],
        spans["attempt a"],
        spans["attempt b"],
    )
    assert root.kind == Span.SPAN_KIND_SERVER
    assert root.trace_id.hex() == CLIENT_TRACE
    assert root.parent_span_id.hex() == CLIENT_SPAN
    for attempt in (first, second):
        assert attempt.kind == Span.SPAN_KIND_CLIENT
        assert attempt.trace_id == root.trace_id
        assert attempt.parent_span_id == root.span_id
    # The time line: a's attempt ends before b's begins; b's ends by the workload's end.
    assert root.start_time_unix_nano <= first.start_time_unix_nano
    assert first.end_time_unix_nano <= second.start_time_unix_nano
    assert second.end_time_unix_nano <= root.end_time_unix_nano

    assert attributes(root.attributes) | {"trio_failover.workload_id": "id"} == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "url.scheme": "http",
        "client.address": "127.0.0.1",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m",
        "trio_failover.workload_id": "id",
        "http.response.status_code": 200,
        "trio_failover.outcome": "completed",
        "trio_failover.node": "b",
        "trio_failover.attempts": 2,
        "trio_failover.queued_ms": 0.0,
        # openai()'s stream tells no usage: estimated, an event for each of
        # its 5 tokens and its stop, a token per 4 bytes of the request.
        "gen_ai.usage.input_tokens": -(-len(STREAMED) // 4),
        "gen_ai.usage.output_tokens": 6,
        "trio_failover.client": "anonymous",
    }
    first_attributes = attributes(first.attributes)
    assert first_attributes["trio_failover.outcome"] == "retryable_response"
    assert first_attributes["http.response.status_code"] == 503
    assert first_attributes["error.type"] == "retryable_response"
    assert first_attributes["server.address"] == "127.0.0.1"
    assert first_attributes["server.port"] == int(a.url.rpartition(":")[2])
    assert first.status.code == Status.STATUS_CODE_ERROR
    assert attributes(second.attributes)["trio_failover.outcome"] == "completed"
    assert second.status.code == Status.STATUS_CODE_UNSET
    assert [event.name for event in second.events] == ["commit", "first_token"]
    # Each node was told its attempt's span as its parent.
    for node, span in (("a", first), ("b", second)):
        (received,) = fleet[node].received
        expected = f"00-{CLIENT_TRACE}-{span.span_id.hex()}-01"
        assert received.header("traceparent") == expected.encode()


def test_the_option_without_the_extra_exits_2_naming_it() -> None:
    # The extra's packages made unimportable, as in an install without [otel].
    script = (
        "import sys; sys.modules['opentelemetry'] = None; "
        "from trio_failover.cli.cli import main; "
        "sys.argv = ['trio-failover', 'serve', '--upstream', 'http://127.0.0.1:9', "
        "'--listen', '127.0.0.1:0', '--admin-listen', 'off', "
        "'--otel-endpoint', 'http://127.0.0.1:4318']; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=20, check=False
    )
    assert done.returncode == 2
    assert done.stderr == (
        "trio-failover: error: --otel-endpoint: invalid value 'http://127.0.0.1:4318' for "
        "otel-endpoint: traces need the OpenTelemetry SDK: the otel extra: pip install"
        " opentelemetry-sdk opentelemetry-exporter-otlp-proto-http\n"
    )


def test_the_receiver_is_quiet_without_traffic() -> None:
    # The guard of the test above: a receiver that invents exports would pass it.
    with otlp_receiver() as receiver:
        try:
            receiver.next_export(0.05)
        except queue.Empty:
            return
    raise AssertionError("an export nobody sent")
