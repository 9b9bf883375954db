"""The liveness checks: one ``GET /health`` per node at a time, for every wait on it.

When a node is asked, what a check is and what its answer does is told in
docs/failover.md ("Liveness checks"). Here: the proxy's ``SilenceWatch``
(``silence.py``) calls ``LivenessChecker.ask`` with a node's name when a
wait on it comes due; the checker coalesces (a check running, or one that
passed less than ``PASS_REUSE`` ago, answers every wait), and runs each
check in its own nursery (``run``, one of the proxy's own tasks), not in an
attempt's task. A pass is counted by the waits that asked
(``SilenceWatch.answered``); a failure is the board's news
(``NodeBoard.liveness_checked``), which ends every wait on the node. With
discovery off the checker asks a down node again itself (``_revive``,
``core.liveness.revive_delay``). Each check is told through ``Report``
(``liveness_checked``).
"""

from __future__ import annotations

import math

import trio

from ...core import errors
from ...core.config import Config, LiveConfig, Upstream, live_config
from ...core.liveness import (
    KIND,
    LIVENESS_PATH,
    CheckRecord,
    check_timeout,
    passes,
    reuses_pass,
    revive_delay,
)
from ...wire.connect import Connector
from ...wire.fetch import fetch_head
from ..report import Report
from .board import NodeBoard
from .silence import SilenceWatch


class LivenessChecker:
    """Runs the liveness checks of one proxy's nodes; ``Proxy`` owns one."""

    def __init__(
        self,
        config: Config | LiveConfig,
        connector: Connector,
        board: NodeBoard,
        report: Report,
        watch: SilenceWatch,
    ) -> None:
        self._settings = live_config(config)
        self.connector = connector
        self.board = board
        self.report = report
        self.watch = watch
        # Every node a check may be asked of: a node a reload removed keeps
        # its definition while attempts still wait on it.
        self._known = {node.name: node for node in self.config.upstreams}
        self._running: set[str] = set()
        self._reviving: set[str] = set()
        self._passed_at: dict[str, float] = {}
        self._path = LIVENESS_PATH.encode()
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the checks asked for until cancelled (one of the proxy's own tasks).

        Cancellation: the running checks close their connections at once.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._running.clear()
            self._reviving.clear()

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def reconcile(self, added: list[str]) -> None:
        """A reload: the nodes' new definitions; added nodes start with no passed check."""
        for node in self.config.upstreams:
            self._known[node.name] = node
        for name in added:
            self._passed_at.pop(name, None)

    def ask(self, name: str) -> None:
        """A wait on ``name`` has been silent a period: check the node, or join its check.

        Not a checkpoint: the check runs in the checker's nursery and its
        answer comes through ``SilenceWatch.answered`` (and the board).
        """
        if name in self._running:
            return  # the running check answers this wait too
        if reuses_pass(self._passed_at.get(name, -math.inf), trio.current_time()):
            self.watch.answered(name, True, "")
            return
        node, nursery = self._known.get(name), self._nursery
        if node is None or nursery is None:
            return
        self._running.add(name)
        nursery.start_soon(self._run, node)

    async def _run(self, node: Upstream) -> None:
        try:
            passed, detail = await self.check(node)
        finally:
            self._running.discard(node.name)
        if passed:
            self._passed_at[node.name] = trio.current_time()
        self.watch.answered(node.name, passed, detail)
        if not passed and not self.config.discovery_interval and node.name not in self._reviving:
            assert self._nursery is not None
            self._reviving.add(node.name)
            self._nursery.start_soon(self._revive, node)

    async def _revive(self, node: Upstream) -> None:
        """With discovery off, re-check a node a check marked down until it answers."""
        failed = 1
        try:
            while self.board.is_down(node.name):
                await trio.sleep(revive_delay(failed))
                if not self.board.is_down(node.name):
                    break
                passed, _ = await self.check(node)
                failed = 0 if passed else failed + 1
                if passed:
                    break
        finally:
            self._reviving.discard(node.name)

    async def check(self, node: Upstream) -> tuple[bool, str]:
        """One ``GET /health`` at ``node``, told through the board and the report.

        Returns whether any status came, and why not. Never raises an
        ``UpstreamError``: a failure is the answer False.
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
        self.board.liveness_checked(node.name, record, now)
        self.report.liveness_checked(node.name, record, elapsed=now - started)
        return ok, f"no answer to GET /health ({error})" if error else ""
