"""OpenTelemetry traces of the workloads (docs/observability.md#traces): the sink ``Report`` calls.

``Report`` imports this module only when ``--otel-endpoint`` is set, so a
proxy without it imports nothing of OpenTelemetry, and its request path
pays one ``if work.trace is not None`` per milestone.

Each workload is a span of kind SERVER (``POST /v1/chat/completions``),
each attempt a child span of kind CLIENT (``attempt gpu-a``); the queue
wait is an event of the workload's span, the commit and the first token
events of the attempt's. Names and values come from ``core/spans.py``. A
client's W3C ``traceparent`` (and ``tracestate``) is continued, and each
attempt sends its node a ``traceparent`` of the attempt's own span, so an
engine that traces (vLLM) hangs its spans below it.

Spans end on the request path and go to the SDK's ``BatchSpanProcessor``,
whose own thread exports them: no request waits for the collector. At exit
the SDK flushes what is left (``TracerProvider`` registers that with
``atexit``).

Time: OpenTelemetry wants wall-clock nanoseconds since the epoch; the
proxy reads only Trio's clock. ``Tracing.epoch_ns`` converts with one
offset, taken at the first span from ``wall_clock_ns``, the package's one
reading of the wall clock (``clock=`` replaces it). Durations are then
exact differences of Trio times, and a test under ``MockClock`` gets
exact timestamps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import trio
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..core.config import Upstream
from ..core.headers import TRACE_CONTEXT, Headers, with_trace_context
from ..core.outcome import AttemptRecord
from ..core.requests import request_model
from ..core.spans import (
    COMMIT,
    FIRST_TOKEN,
    QUEUE_WAIT,
    SpanEnd,
    attempt_attributes,
    attempt_end,
    operation_name,
    traces_url,
    workload_attributes,
    workload_end,
)
from ..core.version import __version__
from ..core.workload import State

__all__ = ["Tracing", "WorkloadTrace", "wall_clock_ns"]

WallClock = Callable[[], int]
# The W3C propagator itself, not the global one: traceparent is the header.
_PROPAGATOR = TraceContextTextMapPropagator()


class TracedWorkload(Protocol):
    """What a trace reads of the shell's ``proxy/records.py`` ``Workload``.

    A protocol, not an import: telemetry/ sits below proxy/ and imports
    only core/ (import-linter's layers contract).
    """

    @property
    def id(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def client(self) -> str | None: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def started(self) -> float: ...
    @property
    def attempt(self) -> int: ...
    @property
    def attempt_started(self) -> float: ...
    @property
    def attempts(self) -> Sequence[AttemptRecord]: ...
    @property
    def state(self) -> State: ...
    @property
    def status(self) -> int | None: ...
    @property
    def committed_at(self) -> float | None: ...
    @property
    def node(self) -> str | None: ...
    @property
    def waited(self) -> float: ...


class TracedRequest(Protocol):
    """What a trace reads and writes of ``wire/upstream.py``'s ``OutgoingRequest``."""

    @property
    def method(self) -> bytes: ...
    @property
    def target(self) -> bytes: ...
    @property
    def headers(self) -> Headers: ...  # the attempt's traceparent is written into it


def wall_clock_ns() -> int:
    """Now, in nanoseconds since the epoch: the package's one reading of the wall clock.

    Only the spans' timestamps need it (log lines take logging's own
    record time); everything else reads Trio's clock.
    """
    return time.time_ns()


class Tracing:
    """Makes the spans of a proxy's workloads with one tracer provider.

    ``Tracing.to_collector(url)`` is what ``--otel-endpoint`` builds; a test
    or an embedder passes a provider of its own (an SDK ``TracerProvider``
    with the span processor it likes).
    """

    def __init__(self, provider: trace.TracerProvider, *, clock: WallClock = wall_clock_ns) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("trio_failover", __version__)
        self._clock = clock
        self._offset: int | None = None

    @classmethod
    def to_collector(cls, endpoint: str) -> Tracing:
        """Spans batched and sent over OTLP/HTTP to the collector at ``endpoint``.

        ``endpoint`` is the collector's base URL (``/v1/traces`` is appended,
        ``core.spans.traces_url``). The exporter also reads OpenTelemetry's
        own variables (``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``,
        ``..._COMPRESSION``...), the batch processor ``OTEL_BSP_*``, the
        resource ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``.
        """
        provider = TracerProvider(resource=_resource())
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def epoch_ns(self, now: float) -> int:
        """The Trio time ``now`` as nanoseconds since the epoch."""
        offset = self._offset
        if offset is None:  # once: the first span's start
            offset = self._offset = self._clock() - round(trio.current_time() * 1e9)
        return offset + round(now * 1e9)

    def workload(
        self,
        work: TracedWorkload,
        headers: Sequence[tuple[bytes, bytes]],
        document: Any,
        client_address: str | None,
        scheme: str,
    ) -> WorkloadTrace:
        """Start the span of a workload, below the client's ``traceparent`` if it sent one."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in TRACE_CONTEXT
        }
        parent = _PROPAGATOR.extract(carrier)  # an empty context without one: a new trace
        model = request_model(document)
        attributes = workload_attributes(
            method=work.method,
            path=work.path,
            scheme=scheme,
            workload_id=work.id,
            model=model,
            client_address=client_address,
            client=work.client,
        )
        span = self.tracer.start_span(
            f"{work.method} {work.path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self.epoch_ns(work.started),
        )
        return WorkloadTrace(self, span, model)

    def shutdown(self) -> None:
        """Export what is still batched and stop (blocks; the SDK also does it at exit)."""
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()


class WorkloadTrace:
    """The spans of one workload: its own, and the open attempt's (None between attempts)."""

    __slots__ = ("_attempt_started", "_records", "_tracing", "attempt", "model", "span")

    def __init__(self, tracing: Tracing, span: trace.Span, model: str | None) -> None:
        self._tracing = tracing
        self.span = span
        self.model = model
        self.attempt: trace.Span | None = None
        self._attempt_started = 0.0
        self._records = 0  # the workload's attempt records when the open attempt began

    def attempt_started(self, work: TracedWorkload, node: Upstream, request: TracedRequest) -> None:
        """Start the attempt's span and put its ``traceparent`` into ``request.headers``.

        The client's own ``traceparent`` and ``tracestate`` are replaced:
        the node's spans belong below this attempt, in the same trace.
        """
        tracing = self._tracing
        model = node.model_name_for(self.model) if self.model is not None else None
        attributes = attempt_attributes(
            method=request.method.decode("ascii"),
            path=request.target.split(b"?", 1)[0].decode("ascii", "replace"),
            node=node.name,
            host=node.host,
            port=node.port,
            model=model,
            attempt=work.attempt,
            workload_id=work.id,
            operation=operation_name(work.path),
        )
        self._attempt_started, self._records = work.attempt_started, len(work.attempts)
        span = tracing.tracer.start_span(
            f"attempt {node.name}",
            context=trace.set_span_in_context(self.span),
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=tracing.epoch_ns(work.attempt_started),
        )
        self.attempt = span
        fields: dict[str, str] = {}
        _PROPAGATOR.inject(fields, context=trace.set_span_in_context(span))
        # The request's own list: it is sent as it is (OutgoingRequest).
        request.headers[:] = with_trace_context(request.headers, fields)

    def attempt_ended(self, record: AttemptRecord) -> None:
        """End the open attempt's span with ``record``'s outcome (at its start + elapsed)."""
        span = self.attempt
        if span is None:  # the client left between attempts: no attempt is open
            return
        self.attempt = None
        end = attempt_end(str(record.outcome), record.elapsed, record.status, record.detail)
        _end(span, end, self._tracing.epoch_ns(self._attempt_started + record.elapsed))

    def committed(self, status: int | None, now: float) -> None:
        """The ``commit`` event: the head goes to the client, nothing is replayed from here."""
        if self.attempt is not None:
            attributes = {} if status is None else {"http.response.status_code": status}
            self.attempt.add_event(COMMIT, attributes, timestamp=self._tracing.epoch_ns(now))

    def first_token(self, now: float) -> None:
        """The ``first_token`` event: the first body byte that is not an SSE comment."""
        if self.attempt is not None:
            self.attempt.add_event(FIRST_TOKEN, timestamp=self._tracing.epoch_ns(now))

    def queue_waited(self, started: float, now: float) -> None:
        """The ``queue_wait`` event, at the wait's start, with its length."""
        attributes = {"trio_failover.wait_ms": round((now - started) * 1000, 1)}
        self.span.add_event(QUEUE_WAIT, attributes, timestamp=self._tracing.epoch_ns(started))

    def finished(self, work: TracedWorkload, now: float) -> None:
        """End the workload's span, and the attempt's if still open.

        An attempt is still open when its end was recorded without a
        milestone of ``Report`` (the record is then the workload's last) or
        not at all (an internal error: ``cancelled``).
        """
        ends = self._tracing.epoch_ns(now)
        if self.attempt is not None:
            if len(work.attempts) > self._records:
                self.attempt_ended(work.attempts[-1])
            else:
                elapsed = now - self._attempt_started
                _end(self.attempt, attempt_end("cancelled", elapsed, None, "not ended"), ends)
                self.attempt = None
        end = workload_end(
            str(work.state),
            work.status,
            committed=work.committed_at is not None,
            last_outcome=str(work.attempts[-1].outcome) if work.attempts else None,
            node=work.node,
            attempts=work.attempt,
            queued=work.waited,
            reason=work.reason,
            tokens=(
                None
                if work.prompt_tokens is None or work.completion_tokens is None
                else (work.prompt_tokens, work.completion_tokens)
            ),
        )
        _end(self.span, end, ends)


def _end(span: trace.Span, end: SpanEnd, at: int) -> None:
    span.set_attributes(end.attributes)
    if end.error is not None:
        span.set_status(Status(StatusCode.ERROR, end.error))
    span.end(end_time=at)


def _resource() -> Resource:
    """The service: ``trio-failover`` and its version, unless ``OTEL_SERVICE_NAME`` names it."""
    resource = Resource.create({"service.version": __version__})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "trio-failover"}))
    return resource
