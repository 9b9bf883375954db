"""The discovery loop: each node's inventory and health, checked on its own schedule.

One task per node, all in one nursery that ``Discovery.run`` opens (one of
the proxy's own tasks). What a check asks and what the answers mean is
told in docs/discovery.md ("The check"), and decided in ``core/checks.py``
and ``core/inventory.py``. Each task waits for its first check
(``checks.first_check_delays``), checks, each question over a fresh
connection (``wire.fetch_if``; ``/v1/models`` and ``/api/tags`` only while
the slot ledger counts no attempt in flight at the node, read before the
connect and again right before the request goes out), hands the verdict to
``NodeBoard.check_finished``, and waits until ``checks.next_check_at`` (or
less when ``NodeBoard.ask_recheck`` asks).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs
import trio

from ...core import errors
from ...core.checks import (
    HEALTH_PATH,
    TAGS_PATH,
    first_check_delays,
    inventory_waits,
    judge_health,
    next_check_at,
    tags_answer,
)
from ...core.config import Config, LiveConfig, Upstream, live_config, take_over
from ...core.engines import Answer as EngineAnswer
from ...core.inventory import (
    CHECK_ANSWER_TIMEOUT,
    CHECK_PATH,
    MAX_LISTING_BYTES,
    CheckFailure,
    CheckVerdict,
    Health,
    judge_check,
)
from ...core.liveness import CheckRecord
from ...telemetry.logs import logger
from ...wire.connect import Connector
from ...wire.fetch import Answer, fetch_if
from ..report import Report
from .board import NodeBoard
from .queue import SlotQueue

_TIMEOUTS = (errors.ConnectTimeout, errors.HeaderTimeout)
_HEALTH_BODY = 4096  # the status is the answer; the body is read only to end it


@attrs.frozen
class _Reply:
    """One question's answer, or why there is none."""

    answer: Answer | None
    failure: CheckFailure | None = None
    detail: str = ""
    streaming: bool = False  # an attempt of the node streamed while it was out
    sent: bool = True  # False: not asked, an attempt began meanwhile


class Discovery:
    """The health and inventory checks of one proxy's nodes."""

    def __init__(
        self,
        config: Config | LiveConfig,
        connector: Connector,
        board: NodeBoard,
        queue: SlotQueue,
        report: Report,
        *,
        jitter: Callable[[], float] = random.random,
        on_checked: Callable[[str, bool, EngineAnswer | None], None] | None = None,
        moving: Callable[[str, float], bool] | None = None,
    ) -> None:
        self._settings = live_config(config)
        # Told after each check (node, good, its /v1/models answer): the
        # engine reader reads then, and detects from it.
        self._on_checked = on_checked
        # Whether a stream of the node relayed a byte lately (``SilenceWatch.moving``):
        # then a check that times out proves nothing.
        self._moving = moving or _never_moving
        self.connector = connector
        self.board = board
        self.queue = queue
        self.report = report
        # Random in [0, 1]: each proxy's checks drift apart from the others'.
        self._jitter = jitter
        # From connection made to whole answer read (10 s); tests shorten it.
        self.answer_timeout = CHECK_ANSWER_TIMEOUT
        # While ``run`` runs: its nursery, and each node's checker's scope.
        self._nursery: trio.Nursery | None = None
        self._tasks: dict[str, trio.CancelScope] = {}

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
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for node, delay in zip(nodes, first_check_delays(len(nodes)), strict=True):
                    self._start(nursery, node, start + delay)
                task_status.started()
        finally:
            self._nursery = None
            self._tasks.clear()

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def _start(self, nursery: trio.Nursery, node: Upstream, first_at: float) -> None:
        scope = self._tasks[node.name] = trio.CancelScope()
        nursery.start_soon(self._checker, node, first_at, scope)

    async def _checker(self, node: Upstream, first_at: float, scope: trio.CancelScope) -> None:
        with scope:
            await self._check_every(node, first_at, self.config.discovery_interval)

    def reconcile(self, config: Config, restart: set[str]) -> None:
        """A reload: check the new nodes, stop checking the removed ones.

        ``restart``: kept nodes whose checks begin again (their URL or TLS
        changed, or the interval did): their checker is cancelled and a new
        one checks the new definition now. Before ``run`` (or with
        discovery off) only the configuration is taken.
        """
        take_over(self._settings, config)
        nursery = self._nursery
        if nursery is None or not config.discovery_interval:
            for scope in self._tasks.values():
                scope.cancel()
            self._tasks.clear()
            return
        names = {node.name for node in config.upstreams}
        for name in [name for name in self._tasks if name not in names or name in restart]:
            self._tasks.pop(name).cancel()
        now = trio.current_time()
        for node in config.upstreams:
            if node.name not in self._tasks:
                self._start(nursery, node, now)

    async def _check_every(self, node: Upstream, first_at: float, interval: float) -> None:
        board = self.board
        deadline = first_at
        down_checks = 0  # checks in a row that left the node down: its re-check backoff
        while True:
            with trio.move_on_at(deadline):
                await board.nodes[node.name].recheck.wait()
            started = trio.current_time()
            board.take_recheck(node.name)  # an ask from now on means "once more"
            listing: EngineAnswer | None = None
            try:
                verdict, listing = await self.check(node)
            except Exception as exc:
                # The check's own boundary, like a workload's: a bug in one
                # check must not end the server (this task is in its nursery).
                logger.exception("health check failed", extra={"fields": {"node": node.name}})
                error = f"health check: internal error ({type(exc).__name__})"
                verdict = CheckVerdict(Health.UNCHANGED, None, False, None, error, "internal_error")
            finished = trio.current_time()
            self.report.health_checked(node.name, verdict.result)
            record = health_check_record(verdict, finished)
            board.check_finished(node.name, verdict, finished, record=record)
            if self._on_checked is not None:
                self._on_checked(node.name, verdict.health is not Health.DOWN, listing)
            down_checks = down_checks + 1 if board.is_down(node.name) else 0
            deadline = next_check_at(
                started=started,
                finished=finished,
                interval=interval,
                jitter=self._jitter(),
                down_checks=down_checks,
            )

    async def check(self, node: Upstream) -> tuple[CheckVerdict, EngineAnswer | None]:
        """One check of ``node``, judged; never raises an error.

        ``/health`` first; ``/v1/models`` and ``/api/tags`` only while no
        attempt of this proxy is in flight at the node (llama-cpp-python
        ends a running generation for any request that needs its model).

        Returns:
            The verdict, and the node's answer to ``/v1/models`` where it
            got one (the engine reader's detection weighs it).
        """
        reply = await self._ask(node, HEALTH_PATH, _HEALTH_BODY)
        first = judge_health(
            failure=reply.failure,
            status=reply.answer.status if reply.answer else None,
            streaming=reply.streaming,
            detail=reply.detail,
        )
        if first.final is not None:
            return first.final, None
        if self._in_flight(node):
            return inventory_waits(has_route=first.has_route), None
        # Asked again once connected: no attempt may begin in between.
        reply = await self._ask(node, CHECK_PATH, MAX_LISTING_BYTES + 1, unless_busy=True)
        if not reply.sent:
            return inventory_waits(has_route=first.has_route), None
        verdict = judge_check(
            failure=reply.failure,
            status=reply.answer.status if reply.answer else None,
            body=reply.answer.body if reply.answer else b"",
            streaming=reply.streaming,
            detail=reply.detail,
            health_route=first.has_route,
        )
        if verdict.health is not Health.DOWN and not self._in_flight(node):
            await self._ask_tags(node)
        answer = reply.answer
        return verdict, None if answer is None else EngineAnswer(answer.status, "", answer.body)

    async def _ask_tags(self, node: Upstream) -> None:
        reply = await self._ask(node, TAGS_PATH, MAX_LISTING_BYTES + 1, unless_busy=True)
        if reply.answer is not None:  # no answer at all keeps the last one
            self.board.keep_tags(node.name, tags_answer(reply.answer.status, reply.answer.body))

    def _in_flight(self, node: Upstream) -> bool:
        # The ledger counts every attempt from its slot to the end of its
        # relay, at nodes of any capacity (0, no limit, included).
        return self.queue.scheduler.ledger.in_flight(node.name) > 0

    async def _ask(
        self, node: Upstream, path: str, limit: int, *, unless_busy: bool = False
    ) -> _Reply:
        """``GET path`` at ``node``: its answer, or the failure and its words.

        ``unless_busy``: not sent (``sent`` False) when, once connected, an
        attempt is in flight at the node.
        """
        try:
            answer = await fetch_if(
                node,
                path.encode(),
                send_if=lambda: not (unless_busy and self._in_flight(node)),
                connector=self.connector,
                config=self.config,
                answer_timeout=self.answer_timeout,
                limit=limit,
            )
        except errors.UpstreamError as exc:
            detail = f"{exc.phase}: {exc.detail}"
            if isinstance(exc, _TIMEOUTS):
                streaming = self._moving(node.name, trio.current_time())
                return _Reply(None, CheckFailure.TIMED_OUT, detail, streaming)
            if isinstance(exc, errors.UpstreamProtocolError):
                return _Reply(None, CheckFailure.NOT_HTTP, detail)
            return _Reply(None, CheckFailure.CONNECT_FAILED, detail)
        if answer is None:
            return _Reply(None, sent=False)
        return _Reply(answer)


def _never_moving(_node: str, _now: float) -> bool:
    return False


def health_check_record(verdict: CheckVerdict, finished: float) -> CheckRecord:
    """A discovery check as ``/status`` shows it (``last_check``, kind ``health``).

    It passed unless it found the node down; its ``status`` is not kept (a
    check asks up to three questions), its ``error`` is the verdict's.
    """
    ok = verdict.health is not Health.DOWN
    return CheckRecord(
        "health", ok=ok, status=None, error=None if ok else verdict.last_error, at=finished
    )
