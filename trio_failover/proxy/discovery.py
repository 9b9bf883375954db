"""The discovery loop: each node's inventory and health, checked on its own schedule.

One task per node, all in one nursery that ``Discovery.run`` opens (the
server's services nursery starts it; an embedder starts it the same way,
``await nursery.start(proxy.run_discovery)``). Each task:

1. waits for its first check: node ``i`` of ``n`` at ``i/n`` seconds after
   start (``inventory.first_check_delays``), so all begin within a second
   and none together;
2. checks: ``GET /v1/models`` over a fresh connection (``wire.fetch``),
   within the connect timeout and then ``CHECK_ANSWER_TIMEOUT``;
3. hands the answer (or its failure) to ``inventory.judge_check`` and the
   verdict to ``Readiness.check_finished``;
4. waits until ``inventory.next_check_at`` (one interval after the check
   began, up to a tenth early by jitter, never before it ended: one check
   per node at a time), or less when a stale-inventory ``404`` asks for a
   re-check (``Report.health.ask_recheck``).

A check is not an attempt: no slot, no ``in_flight``, no pooled connection.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import trio

from ..core import errors
from ..core.config import Config, Upstream
from ..core.inventory import (
    CHECK_ANSWER_TIMEOUT,
    CHECK_PATH,
    MAX_LISTING_BYTES,
    CheckFailure,
    CheckVerdict,
    Health,
    first_check_delays,
    judge_check,
    next_check_at,
)
from ..service.logs import logger
from ..wire.connect import Connector
from ..wire.fetch import fetch
from .report import Report

_TIMEOUTS = (errors.ConnectTimeout, errors.HeaderTimeout)


class Discovery:
    """The health and inventory checks of one proxy's nodes."""

    def __init__(
        self,
        config: Config,
        connector: Connector,
        report: Report,
        *,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self.connector = connector
        self.report = report
        # Random in [0, 1]: each proxy's checks drift apart from the others'.
        self._jitter = jitter
        # From connection made to whole answer read (SPEC 5a: 10 s); tests shorten it.
        self.answer_timeout = CHECK_ANSWER_TIMEOUT

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check every node until cancelled; returns at once when discovery is off.

        Cancellation: a running check closes its connection at once.
        """
        interval = self.config.discovery_interval
        if not interval:
            task_status.started()
            return
        nodes = self.config.upstreams
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for node, delay in zip(nodes, first_check_delays(len(nodes)), strict=True):
                nursery.start_soon(self._check_every, node, start + delay, interval)
            task_status.started()

    async def _check_every(self, node: Upstream, first_at: float, interval: float) -> None:
        health = self.report.health
        deadline = first_at
        while True:
            with trio.move_on_at(deadline):
                await health.nodes[node.name].recheck.wait()
            started = trio.current_time()
            health.take_recheck(node.name)  # an ask from now on means "once more"
            try:
                verdict = await self.check(node)
            except Exception as exc:
                # The check's own boundary, like a workload's: a bug in one
                # check must not end the server (this task is in its nursery).
                logger.exception("health check failed", extra={"fields": {"node": node.name}})
                error = f"health check: internal error ({type(exc).__name__})"
                verdict = CheckVerdict(Health.UNCHANGED, None, False, None, error, "internal_error")
            finished = trio.current_time()
            self.report.readiness.check_finished(node.name, verdict, finished)
            deadline = next_check_at(
                started=started, finished=finished, interval=interval, jitter=self._jitter()
            )

    async def check(self, node: Upstream) -> CheckVerdict:
        """One check of ``node``, judged (``inventory.judge_check``); never raises an error."""
        started = trio.current_time()
        try:
            answer = await fetch(
                node,
                CHECK_PATH.encode(),
                connector=self.connector,
                config=self.config,
                answer_timeout=self.answer_timeout,
                limit=MAX_LISTING_BYTES + 1,
            )
        except errors.UpstreamError as exc:
            detail = f"{exc.phase}: {exc.detail}"
            if isinstance(exc, _TIMEOUTS):
                streaming = self.report.health.streamed_since(node.name, started)
                return judge_check(
                    failure=CheckFailure.TIMED_OUT, streaming=streaming, detail=detail
                )
            if isinstance(exc, errors.UpstreamProtocolError):
                return judge_check(failure=CheckFailure.NOT_HTTP, detail=detail)
            return judge_check(failure=CheckFailure.CONNECT_FAILED, detail=detail)
        return judge_check(status=answer.status, body=answer.body)
