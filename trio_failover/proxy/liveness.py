"""The liveness checks: one ``GET /health`` per node at a time, for every attempt waiting on it.

An attempt whose node stays silent for a response-header timeout (an
unstreamed request's head, a first body byte with first-body-timeout 0)
asks ``LivenessChecker.still_alive`` (the ``wire.watched.Liveness``
protocol) between its windows. The checker coalesces: while a check of a
node runs, every other attempt that asks waits for the same answer, and a
check that passed less than ``PASS_REUSE`` ago answers without asking again
(SPEC 5.5). 50 attempts waiting on one frozen node make one ``GET /health``
per window, not 50.

A check runs in the task of the attempt that asked first, not in a task of
its own: no task per attempt, nothing running once nobody waits. If that
attempt goes away (its client left), its check is cancelled and its
connection closed at once; an attempt still waiting then runs the next one.

A check is not an attempt: a fresh connection (``wire.fetch.fetch_head``),
never pooled, no slot of the capacity ledger, the node's headers and TLS
settings, the connect timeout and ``check_timeout`` for the head. It runs
whether discovery is on or off. Each one is told through ``Report``
(``liveness_checked``: the ``check`` event, ``/status``' ``last_check``,
the metric).
"""

from __future__ import annotations

import math

import attrs
import trio

from ..core import errors
from ..core.config import Config, Upstream
from ..core.liveness import KIND, LIVENESS_PATH, CheckRecord, check_timeout, passes, reuses_pass
from ..wire.connect import Connector
from ..wire.fetch import fetch_head
from .board import NodeBoard
from .report import Report


@attrs.define
class _Check:
    """One check of a node, its waiters and, once it ended, its answer (None: abandoned)."""

    done: trio.Event = attrs.Factory(trio.Event)
    passed: bool | None = None


@attrs.define
class _NodeChecks:
    running: _Check | None = None
    passed_at: float = -math.inf


class LivenessChecker:
    """Runs the liveness checks of one proxy's nodes; ``Proxy`` owns one."""

    def __init__(
        self, config: Config, connector: Connector, board: NodeBoard, report: Report
    ) -> None:
        self.config = config
        self.connector = connector
        self.board = board
        self.report = report
        self._nodes = {node.name: _NodeChecks() for node in config.upstreams}
        self._path = LIVENESS_PATH.encode()

    def reconcile(self, added: list[str]) -> None:
        """A reload: fresh books for the added nodes (a removed node's stay for its attempts)."""
        for name in added:
            self._nodes[name] = _NodeChecks()

    async def still_alive(self, node: Upstream) -> bool:
        """Whether ``node`` answers: a check of it, shared with every attempt that asks meanwhile.

        Cancellation: an attempt cancelled while it runs the check closes
        the check's connection; another waiter then checks anew.
        """
        books = self._nodes[node.name]
        if reuses_pass(books.passed_at, trio.current_time()):
            await trio.lowlevel.checkpoint()  # async means a checkpoint, always
            return True
        # A second round only when the attempt that ran the check went away
        # before its answer: then one of those still waiting runs the next.
        while True:
            check = books.running
            if check is None:
                return await self._run(node, books)
            await check.done.wait()
            if check.passed is not None:
                return check.passed

    async def _run(self, node: Upstream, books: _NodeChecks) -> bool:
        check = books.running = _Check()
        try:
            check.passed = await self.check(node)
        finally:
            books.running = None
            check.done.set()
        if check.passed:
            books.passed_at = trio.current_time()
        return check.passed

    async def check(self, node: Upstream) -> bool:
        """One ``GET /health`` at ``node``, told through the report; True: any status came.

        Never raises an ``UpstreamError``: a failure is the answer False.
        """
        started = trio.current_time()
        status: int | None = None
        error: str | None = None
        try:
            status = await fetch_head(
                node,
                self._path,
                connector=self.connector,
                config=self.config,
                head_timeout=check_timeout(self.config.response_header_timeout),
            )
        except errors.UpstreamError as exc:
            error = f"{exc.phase}: {exc.detail}"
        now = trio.current_time()
        ok = passes(status)
        record = CheckRecord(KIND, ok, status, error, now)
        self.board.liveness_checked(node.name, record)
        self.report.liveness_checked(node.name, record, elapsed=now - started)
        return ok
