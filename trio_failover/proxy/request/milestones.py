"""The milestones of a workload: execute the core's verdict, tell the report.

An attempt failed before commit, a head was committed, a committed stream
ended, the client left: each is judged by ``core/outcome.py`` (fail over?
cool the node, how long? ask for a health check?) and recorded through
the node board (node state) and ``Report`` (telemetry). The workload
shell (``workload.py``, ``attempts.py``) calls these; nothing here waits.

A demotion covers the node, or on a node serving more than one model only
the workload's model (``engines.cooldown_scope``); a served
answer ends its model's cooldown as well as the node's.
"""

from __future__ import annotations

import trio

from ...core.config import Config, LiveConfig, Upstream, live_config
from ...core.engines import Scope, cooldown_scope, serves_many
from ...core.errors import RetryableResponse, UpstreamError
from ...core.outcome import AttemptRecord, Outcome, judge, retry_after_of
from ...core.workload import State
from ...wire.upstream import UpstreamResponse
from ..nodes.board import NodeBoard
from ..records import Workload
from ..report import Report


class Milestones:
    """Records a workload's milestones and executes their verdicts."""

    def __init__(self, config: Config | LiveConfig, board: NodeBoard, report: Report) -> None:
        self._settings = live_config(config)
        self.board = board
        self.report = report

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def attempt_failed(
        self, work: Workload, node: Upstream, failure: UpstreamError, *, last: bool
    ) -> bool:
        """Record a failed attempt and execute its verdict; True: try the next node."""
        now = trio.current_time()
        status = failure.status if isinstance(failure, RetryableResponse) else None
        retry_after = (
            retry_after_of(failure.status, failure.headers)
            if isinstance(failure, RetryableResponse)
            else None
        )
        verdict = judge(
            failure.outcome,
            response_header_timeout=self.config.response_header_timeout,
            retry_after=retry_after,
        )
        record = AttemptRecord(
            node=node.name,
            outcome=failure.outcome,
            elapsed=now - work.attempt_started,
            status=status,
            detail=str(failure),
        )
        work.asked(failure.checks)
        work.record(record)
        self.board.attempt_ended(node.name, str(failure.outcome), record.detail, failed=True)
        self.report.attempt_failed(work, record, moving_on=verdict.fail_over and not last)
        if verdict.cooldown > 0:
            self._demote(work, node, verdict.cooldown, str(failure.outcome), status, now)
        if verdict.recheck:
            self.board.ask_recheck(node.name)
        return verdict.fail_over

    def committed(self, work: Workload, node: Upstream, response: UpstreamResponse) -> None:
        """The head goes to the client: nothing is replayed from here on."""
        timings = response.timings
        # The attempt read the clock last when its first bytes came, and
        # nothing has waited since.
        now = timings.first_body
        work.committed(now, response.status)
        if response.checks:
            work.asked(response.checks)
        self.board.served(node.name, response.status, now, model=work.model)
        self.report.committed(work, node.name, timings.head - timings.written, now)

    def stream_ended(self, work: Workload, node: Upstream, outcome: Outcome, detail: str) -> None:
        """A committed stream ended, whole or cut; a cut one may cool the node."""
        now = trio.current_time()
        record = AttemptRecord(node.name, outcome, now - work.attempt_started, work.status, detail)
        work.record(record)
        work.finish(State.COMPLETED if outcome is Outcome.COMPLETED else State.FAILED)
        failed = outcome is not Outcome.COMPLETED
        self.board.attempt_ended(node.name, str(outcome), detail if failed else None, failed=failed)
        self.report.stream_ended(work, record)
        verdict = judge(outcome, response_header_timeout=self.config.response_header_timeout)
        if verdict.cooldown > 0:
            self._demote(work, node, verdict.cooldown, str(outcome), None, now)

    def _demote(
        self,
        work: Workload,
        node: Upstream,
        duration: float,
        outcome: str,
        status: int | None,
        now: float,
    ) -> None:
        """Cool ``node`` down, or only the workload's model of it."""
        model = work.model
        if model is not None:
            many = serves_many(node.models, self.board.inventories.get(node.name))
            if cooldown_scope(outcome, status, serves_many=many) is Scope.NODE:
                model = None
        self.board.demote(node.name, duration, outcome, now, model=model)

    def client_aborted(self, work: Workload) -> None:
        """The client left before the workload was settled."""
        record = None
        if work.node is not None:
            detail = f"client {work.client_left.value if work.client_left else 'left'}"
            elapsed = trio.current_time() - work.attempt_started
            record = AttemptRecord(work.node, Outcome.CLIENT_ABORT, elapsed, detail=detail)
            work.record(record)
        work.finish(State.CANCELLED, Outcome.CLIENT_ABORT.value)
        self.report.client_aborted(work, record)
