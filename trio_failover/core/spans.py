"""Pure: what a workload's trace says (docs/observability.md#traces), as plain names and values.

``telemetry/tracing.py`` hands these to the OpenTelemetry SDK; nothing here
imports it. Attribute names follow OpenTelemetry's semantic conventions
where one fits (HTTP: ``http.request.method``, ``url.path``,
``server.address``, ``http.response.status_code``, ``error.type``; GenAI:
``gen_ai.request.model``, ``gen_ai.operation.name``) and are the project's
own under ``trio_failover.`` for the rest.

A workload's span ends with the workload's final state as its outcome
(``completed``, ``failed``, ``cancelled``); an attempt's span with the
attempt's outcome (``core/outcome.py``: ``completed``, ``connect_failed``,
``client_abort``...). Which of them count as an error, and with which
``error.type``, is decided here (``workload_end``, ``attempt_end``).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

Attributes = dict[str, str | int | float]

TRACES_PATH = "/v1/traces"

# Event names on the spans (the span's own time line).
QUEUE_WAIT = "queue_wait"
COMMIT = "commit"
FIRST_TOKEN = "first_token"

# GenAI's gen_ai.operation.name for the inference routes whose meaning is
# known; other paths get none ("where it fits").
OPERATIONS: Mapping[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/api/chat": "chat",
    "/api/generate": "text_completion",
    "/api/embed": "embeddings",
    "/api/embeddings": "embeddings",
}

# error.type when the HTTP conventions have no better value (their "_OTHER").
OTHER_ERROR = "_OTHER"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's ``endpoint``.

    As ``OTEL_EXPORTER_OTLP_ENDPOINT`` is read by every OpenTelemetry SDK:
    the collector's base URL, to which ``/v1/traces`` is appended; a URL
    that ends with it already is used as it is.
    """
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def operation_name(path: str) -> str | None:
    """GenAI's ``gen_ai.operation.name`` of a request path, if the route is known."""
    return OPERATIONS.get(path.rstrip("/") or "/")


def workload_attributes(
    *,
    method: str,
    path: str,
    scheme: str,
    workload_id: str,
    model: str | None,
    client_address: str | None,
    client: str | None,
) -> Attributes:
    """The attributes a workload's (SERVER) span starts with."""
    attributes: Attributes = {
        "http.request.method": method,
        "url.path": path,
        "url.scheme": scheme,
        "trio_failover.workload_id": workload_id,
    }
    return _known(
        attributes,
        {
            "gen_ai.operation.name": operation_name(path),
            "gen_ai.request.model": model,
            "client.address": client_address,
            "trio_failover.client": client,
        },
    )


def _known(attributes: Attributes, optional: Mapping[str, str | int | None]) -> Attributes:
    """``attributes`` with those of ``optional`` whose value is known (not None)."""
    attributes.update((name, value) for name, value in optional.items() if value is not None)
    return attributes


def attempt_attributes(
    *,
    method: str,
    path: str,
    node: str,
    host: str,
    port: int,
    model: str | None,
    attempt: int,
    workload_id: str,
    operation: str | None,
) -> Attributes:
    """The attributes an attempt's (CLIENT) span starts with.

    ``path`` and ``model`` are the node's: its target (with the node's base
    path) and its own name for the model; ``operation`` is the workload's
    (``operation_name`` of the client's path).
    """
    attributes: Attributes = {
        "http.request.method": method,
        "url.path": path,
        "server.address": host,
        "server.port": port,
        "trio_failover.node": node,
        "trio_failover.attempt": attempt,
        "trio_failover.workload_id": workload_id,
    }
    return _known(attributes, {"gen_ai.operation.name": operation, "gen_ai.request.model": model})


@attrs.frozen
class SpanEnd:
    """How a span ends: attributes to add, and the error it records (None: none).

    ``error`` is the span status's description when the span ends in error;
    ``error.type`` is among the attributes then.
    """

    attributes: Attributes
    error: str | None = None


def attempt_end(outcome: str, elapsed: float, status: int | None, detail: str) -> SpanEnd:
    """The end of an attempt's span: its outcome, elapsed time and node status.

    Any outcome but ``completed`` is an error of the attempt, its outcome
    the ``error.type`` (``connect_failed``, ``retryable_response``,
    ``client_abort``...): the attempt did not deliver an answer.
    """
    attributes: Attributes = {
        "trio_failover.outcome": outcome,
        "trio_failover.elapsed_ms": round(elapsed * 1000, 1),
    }
    if status is not None:
        attributes["http.response.status_code"] = status
    if outcome == "completed":
        return SpanEnd(attributes)
    attributes["error.type"] = outcome
    return SpanEnd(attributes, detail or outcome)


def workload_end(
    state: str,
    status: int | None,
    *,
    committed: bool,
    last_outcome: str | None,
    node: str | None,
    attempts: int,
    queued: float,
    reason: str | None = None,
    tokens: tuple[int, int] | None = None,
) -> SpanEnd:
    """The end of a workload's span, from its final state and the status it answered.

    ``cancelled`` (the client left, or the drain's end cut it) is an error
    of type ``cancelled``, with ``reason`` (``client_abort``, ``shutdown``)
    as ``trio_failover.reason``, the access line's and events' ``reason``.
    ``tokens`` (prompt, completion), when the answer's are known, become
    the GenAI conventions' ``gen_ai.usage.input_tokens`` and
    ``gen_ai.usage.output_tokens``. A
    ``failed`` workload is one after the HTTP conventions for a server: a
    stream cut after commit has its cut's outcome as ``error.type``; an
    answer of the proxy's own, its status (``"502"``, ``"503"``, ``"504"``),
    an error when it is a 5xx only (a ``404`` for a model no node serves
    is the client's mistake, not the server's).
    """
    attributes: Attributes = {
        "trio_failover.outcome": state,
        "trio_failover.attempts": attempts,
        "trio_failover.queued_ms": round(queued * 1000, 1),
    }
    optional = {"http.response.status_code": status, "trio_failover.node": node}
    _known(attributes, {**optional, "trio_failover.reason": reason})
    if tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = tokens[0]
        attributes["gen_ai.usage.output_tokens"] = tokens[1]
    if state == "cancelled":
        attributes["error.type"] = "cancelled"
        return SpanEnd(attributes, "cancelled")
    if state != "failed":
        return SpanEnd(attributes)
    if committed:
        error_type = last_outcome or OTHER_ERROR
        attributes["error.type"] = error_type
        return SpanEnd(attributes, f"the stream was cut: {error_type}")
    if status is not None and status < 500:
        return SpanEnd(attributes)
    attributes["error.type"] = str(status) if status is not None else OTHER_ERROR
    return SpanEnd(attributes, f"answered {status}" if status is not None else "failed")
