"""A small OTLP/HTTP receiver for the tests: ``POST /v1/traces``, protobuf bodies kept.

A stdlib ``ThreadingHTTPServer`` on ``127.0.0.1:0`` in a thread of its own:
the exporter under test runs in another process (or in the SDK's own
thread), and the test waits for a body with ``next_export``. Bodies are
decoded with ``opentelemetry-proto``'s ``ExportTraceServiceRequest``, so
the wire format is checked, not assumed.
"""

from __future__ import annotations

import http.server
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@attrs.frozen
class Export:
    """One POST the receiver got."""

    path: str
    content_type: str
    request: ExportTraceServiceRequest

    def spans(self) -> list[Span]:
        return [
            span
            for resource in self.request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def resource(self) -> dict[str, Any]:
        (resource,) = self.request.resource_spans
        return attributes(resource.resource.attributes)


def value(any_value: AnyValue) -> Any:
    """The Python value of an OTLP ``AnyValue`` (the scalar kinds spans carry)."""
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


def attributes(pairs: Any) -> dict[str, Any]:
    items: list[KeyValue] = list(pairs)
    return {pair.key: value(pair.value) for pair in items}


class Receiver:
    """The receiver's address and what it received, in order."""

    def __init__(self, server: http.server.ThreadingHTTPServer) -> None:
        self.server = server
        self.exports: queue.Queue[Export] = queue.Queue()

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def next_export(self, timeout: float) -> Export:
        """The next POST's body; ``queue.Empty`` if none comes within ``timeout`` seconds."""
        return self.exports.get(timeout=timeout)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """Serve ``POST /v1/traces`` on ``127.0.0.1:0`` until the block ends."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            request = ExportTraceServiceRequest.FromString(body)
            content_type = self.headers.get("content-type", "")
            receiver.exports.put(Export(self.path, content_type, request))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: pytest shows the test's own output

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
