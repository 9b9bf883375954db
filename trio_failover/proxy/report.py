"""What the proxy tells about its work: the recent and live workloads, and
the events, metrics, log lines and traces of its milestones.

``Report`` is a sink for telemetry only: the workload shell
(``workload.py``, ``attempts.py``, ``milestones.py``) calls it at each
milestone, with the workload's record (``records.py``). It writes no node
state (the node board, ``board.py``, does; ``node_news.py`` tells its
changes) and hands out no slots. ``StatusView`` (``status.py``) reads the
workloads it keeps.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from ..core.config import Config, LiveConfig, live_config
from ..core.liveness import CheckRecord
from ..core.names import model_key
from ..core.outcome import AttemptRecord, Outcome
from ..core.usage_book import Counts, Pair, UsageBook
from ..core.workload import State
from ..telemetry.events import EventBus
from ..telemetry.logs import access_logger, log_access, logger
from ..telemetry.metrics import Metrics
from ..wire.client import ClientRequest
from .records import Workload, ms

if TYPE_CHECKING:  # imported at run time only with traces on (it imports OpenTelemetry)
    from ..core.config import Upstream
    from ..telemetry.tracing import Tracing
    from ..wire.upstream import OutgoingRequest

RECENT_WORKLOADS = 50
# The ``client`` label of the workloads metric when no key is configured
# (with keys, every workload has its key's name; the two never mix).
ANONYMOUS = "anonymous"


class Report:
    """The telemetry of the proxy's work, and the recent and live workloads."""

    def __init__(self, config: Config | LiveConfig) -> None:
        self._settings = live_config(config)
        self.events = EventBus()
        self.metrics = Metrics(node.name for node in self.config.upstreams)
        # Finished workloads and when they ended; summarised only when asked.
        self.recent: deque[tuple[Workload, float]] = deque(maxlen=RECENT_WORKLOADS)
        # Workloads not finished yet, oldest first (keyed by identity).
        self.live: dict[int, Workload] = {}
        # Requests each client's rpm or tpm refused (429 rate_limited), for /status.
        self.limits_hit: dict[str, int] = {}
        # Every client's requests, tokens and slot-seconds (``GET /usage``).
        self.usage = UsageBook()
        # With a shared state, where each finished request's usage is told
        # too (``fleet/shared_usage.FleetUsage.told``): the fleet's totals.
        self.share_usage: Callable[[Pair, str | None, Counts], None] | None = None
        # The traces' sink. None: traces off, OpenTelemetry not even imported.
        self.tracing: Tracing | None = None
        if self.config.otel_endpoint is not None:
            from ..telemetry.tracing import Tracing

            self.tracing = Tracing.to_collector(self.config.otel_endpoint)

    # -- attempts ------------------------------------------------------------

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def attempt_started(self, work: Workload, node: Upstream, request: OutgoingRequest) -> None:
        """An attempt begins: its ``workload`` event; with traces on, its span.

        The span's ``traceparent`` goes into ``request.headers``.
        """
        self.publish_workload(work)
        if work.trace is not None:
            work.trace.attempt_started(work, node, request)

    def attempt_failed(self, work: Workload, record: AttemptRecord, *, moving_on: bool) -> None:
        """Tell a failed attempt before commit (the record kept it already)."""
        if work.trace is not None:
            work.trace.attempt_ended(record)
        self.metrics.attempt_ended(record.node, str(record.outcome))
        if moving_on:
            self.metrics.child(self.metrics.failovers, record.node, str(record.outcome)).inc()
        logger.warning(
            "failover" if moving_on else "attempt failed",
            extra={"fields": {"id": work.id, **record.to_json()}},
        )

    def committed(self, work: Workload, node: str, time_to_head: float, now: float) -> None:
        """Count a commit in the metrics; its ``workload`` event; with traces on, its span."""
        self.metrics.committed(node, time_to_head, now - work.started)
        self.publish_workload(work)
        if work.trace is not None:
            work.trace.committed(work.status, now)

    def stream_ended(self, work: Workload, record: AttemptRecord) -> None:
        """Tell how a committed stream ended (the record kept it already)."""
        if work.trace is not None:
            work.trace.attempt_ended(record)
        self.metrics.attempt_ended(record.node, str(record.outcome))
        if record.outcome is Outcome.COMPLETED:
            return
        logger.warning("stream aborted", extra={"fields": {"id": work.id, **record.to_json()}})

    def client_aborted(self, work: Workload, record: AttemptRecord | None) -> None:
        """Tell that the client left before the workload was settled."""
        if record is not None:
            self.metrics.attempt_ended(record.node, str(record.outcome))
            if work.trace is not None:
                work.trace.attempt_ended(record)
        self.metrics.client_aborts.inc()

    def resent(self, node: str, count: int) -> None:
        """Count requests sent again because a pooled connection to ``node`` was stale."""
        self.metrics.child(self.metrics.stale_resends, node).inc(count)

    # -- checks --------------------------------------------------------------

    def health_checked(self, node: str, result: str) -> None:
        """Count a finished discovery check (``CheckVerdict.result``)."""
        self.metrics.child(self.metrics.checks, node, result).inc()

    def liveness_checked(self, node: str, record: CheckRecord, *, elapsed: float) -> None:
        """Tell a finished liveness check: metric, log line, ``check`` event."""
        result = "passed" if record.ok else "failed"
        self.metrics.child(self.metrics.liveness_checks, node, result).inc()
        event = {
            "type": "check",
            "node": node,
            "kind": record.kind,
            "ok": record.ok,
            "status": record.status,
            "error": record.error,
            "elapsed_ms": ms(elapsed),
        }
        fields = {key: value for key, value in event.items() if key != "type"}
        if record.ok:
            logger.info("liveness check passed", extra={"fields": fields})
        else:
            logger.warning("liveness check failed", extra={"fields": fields})
        self.events.publish(event)

    # -- workloads -----------------------------------------------------------

    def started(
        self,
        work: Workload,
        request: ClientRequest | None = None,
        document: Any = None,
        client_address: str | None = None,
        scheme: str = "http",
    ) -> None:
        """A workload begins: ``/status`` lists it until ``finish``; with traces on, its span.

        ``request`` (its headers: the client's ``traceparent``), ``document``
        (the model), ``client_address`` and ``scheme`` are for the span only.
        """
        self.live[id(work)] = work
        if self.tracing is not None:
            headers = request.headers if request is not None else []
            work.traced(self.tracing.workload(work, headers, document, client_address, scheme))

    def waited(self, work: Workload, started: float, now: float) -> None:
        """Tell of one wait in the queue that ended (with a slot or not)."""
        self.metrics.queue_wait.observe(now - started)
        if work.trace is not None:
            work.trace.queue_waited(started, now)

    def turned_away(self, reason: str) -> None:
        """The queue refused a workload: ``queue_full``, ``queue_timeout`` or ``shutdown``."""
        self.metrics.child(self.metrics.queue_rejected, reason).inc()

    def publish_workload(self, work: Workload, *, position: int | None = None) -> None:
        """A ``workload`` event of the workload's current state (if anyone listens).

        ``position``: its place in the queue as it starts waiting (1 = next).
        """
        if not self.events.subscriber_count:
            return  # no dashboard open: nothing to build
        self.events.publish(workload_event(work, position))

    def finish(self, work: Workload) -> None:
        """Keep, count, publish and log a finished workload."""
        now = trio.current_time()
        self.live.pop(id(work), None)
        self.recent.append((work, now))
        client = ANONYMOUS if work.client is None else work.client
        self.metrics.finished(str(work.state), client, work.node, now - work.started)
        self._count_usage(work, client, now)
        if work.trace is not None:
            work.trace.finished(work, now)
        if self.events.subscriber_count:
            self.events.publish({"type": "workload", **work.summary(now), "attempt": work.attempt})
        if not access_logger.isEnabledFor(logging.INFO):
            return
        log_access(
            {
                "id": work.id,
                "method": work.method,
                "path": work.path,
                "client": work.client,
                "status": work.status,
                "state": str(work.state),
                "nodes": [f"{r.node}:{r.outcome}" for r in work.attempts],
                "checks": work.checks,
                # _ms spelled out: three calls less on every request.
                "commit_ms": (
                    round((work.committed_at - work.started) * 1000, 1)
                    if work.committed_at is not None
                    else None
                ),
                "duration_ms": round((now - work.started) * 1000, 1),
                "queued_ms": round(work.waited * 1000, 1),
                "bytes": work.body_bytes,
                **({} if work.reason is None else {"reason": work.reason}),
                **({"resends": work.resends} if work.resends else {}),
                **(
                    {}
                    if work.prompt_tokens is None
                    else {
                        "prompt_tokens": work.prompt_tokens,
                        "completion_tokens": work.completion_tokens,
                        "usage_estimated": work.usage_estimated,
                    }
                ),
                **(
                    {}
                    if work.matched_bytes is None
                    else {
                        "affinity": "hit" if work.matched_bytes else "miss",
                        "matched_bytes": work.matched_bytes,
                    }
                ),
            }
        )

    def _count_usage(self, work: Workload, client: str, now: float) -> None:
        """Count a finished workload's request, tokens and slot-seconds (``GET /usage``).

        A request its client's limits refused (``429``, nothing sent to a
        node) used nothing: it is counted as a limit hit only.
        """
        if work.status == 429 and not work.attempts:
            self.limits_hit[client] = self.limits_hit.get(client, 0) + 1
            return
        prompt, completion = work.prompt_tokens or 0, work.completion_tokens or 0
        # Each attempt held its slot from its connect to its end (its record's elapsed).
        slot_seconds = sum(record.elapsed for record in work.attempts)
        model = self.usage.add(
            client,
            work.model,
            prompt=prompt,
            completion=completion,
            estimated=work.usage_estimated,
            slot_seconds=slot_seconds,
            now=now,
        )
        if self.share_usage is not None:
            counts = Counts(1, prompt, completion, int(work.usage_estimated), slot_seconds)
            self.share_usage((client, None if model is None else model_key(model)), model, counts)
        if work.prompt_tokens is not None and work.node is not None:
            self.metrics.used(client, "" if model is None else model, work.node, prompt, completion)

    def unauthorized(
        self,
        request_id: str,
        method: str,
        path: str,
        started: float,
        sent: int = 0,
        *,
        status: int = 401,
    ) -> None:
        """Count and log a request refused for want of a valid key (no workload).

        It stays out of ``/status`` and the events: a client without a key
        must not be able to push the fleet's workloads out of view. A
        ``400`` (a client header that names no valid client) is logged, not counted.
        """
        if status == 401:
            self.metrics.child(self.metrics.unauthorized, "client").inc()
        log_access(
            {
                "id": request_id,
                "method": method,
                "path": path,
                "client": None,
                "status": status,
                "state": "unauthorized",
                "nodes": [],
                "commit_ms": None,
                "duration_ms": ms(trio.current_time() - started),
                "bytes": sent,  # the 401's own body
            }
        )


def log_listed(
    request_id: str,
    path: str,
    client: str | None,
    status: int,
    nodes: list[str],
    started: float,
    sent: int,
) -> None:
    """Log the access line of a fleet list the proxy answered itself (no workload).

    ``nodes``: each node asked live as ``node:result`` (``proxy/nodes/lists.py``).
    Like a 401, it stays out of ``/status`` and the events: clients such
    as Open WebUI load the list on every page and would push the fleet's
    workloads out of view.
    """
    log_access(
        {
            "id": request_id,
            "method": "GET",
            "path": path,
            "client": client,
            "status": status,
            "state": str(State.COMPLETED if status < 400 else State.FAILED),
            "nodes": nodes,
            "commit_ms": None,
            "duration_ms": ms(trio.current_time() - started),
            "queued_ms": 0.0,
            "bytes": sent,
        }
    )


def workload_event(work: Workload, position: int | None) -> dict[str, Any]:
    """The ``workload`` event of ``work``'s current state.

    ``position``: its place in the queue as it starts waiting (1 = next).
    """
    event: dict[str, Any] = {
        "type": "workload",
        "id": work.id,
        "state": str(work.state),
        "node": work.node,
        "attempt": work.attempt,
        "method": work.method,
        "path": work.path,
        "client": work.client,
        "model": work.model,
    }
    if work.status is not None:
        event["status"] = work.status
    if position is not None:
        event["position"] = position
    return event
