"""One workload: its nursery and the watcher of the client.

A workload runs in its own nursery. Its body tries the candidates one after
another (``attempts.py``) and, after commit, relays the stream
(``relay.py``); beside it runs a watcher of the client connection. The
watcher cancels the body when the client leaves (FIN or RST, per
``--client-close``); the body, when it is done, sets the workload's event
and the watcher returns. Cancelling an attempt closes its upstream socket
at once (``upstream.open_response`` does it in ``finally``).

Decisions (candidate order, failover, cooldown, the request for a node) come
from the pure core (``ranking``, ``outcome``, ``requests``); ``attempts.py``
and ``milestones.py`` execute them and tell ``Report`` what happened;
``answers.py`` writes the answers the proxy makes itself.
"""

from __future__ import annotations

import trio

from ...core.config import Config, LiveConfig, live_config
from ...core.engine_book import EngineBook
from ...core.outcome import AttemptRecord, Outcome
from ...core.requests import workload_id
from ...core.sharing import ANONYMOUS
from ...core.workload import FINAL, State
from ...telemetry.logs import logger
from ...wire.client import ClientConnection, ClientRequest, Closed
from ...wire.pool import ConnectionPool
from ...wire.upstream import Connector
from ..nodes.board import NodeBoard
from ..nodes.queue import REFUSALS, SlotQueue
from ..nodes.silence import SilenceWatch
from ..records import Workload
from ..report import Report
from .answers import send_failure
from .attempts import Attempts
from .milestones import Milestones
from .relay import Relay
from .sharing import ClientShares

# How long a workload that the proxy's stop cuts short may still take to
# tell its client so (a 503, when nothing was sent yet): the stop waits for
# it, shielded, and a client that does not read must not hold it up.
SHUTDOWN_ANSWER_TIMEOUT = 1.0
# The longest "model" a workload's summary repeats (the ranking sees it whole).
MODEL_SHOWN = 256


class WorkloadRunner:
    """Runs each request of a client connection as one workload."""

    def __init__(
        self,
        config: Config | LiveConfig,
        connector: Connector,
        pool: ConnectionPool,
        board: NodeBoard,
        queue: SlotQueue,
        report: Report,
        silence: SilenceWatch | None = None,
        engines: EngineBook | None = None,
    ) -> None:
        self._settings = live_config(config)
        # The streams' idle timers; ``serve()`` runs its ``watch``.
        self.silence = silence if silence is not None else SilenceWatch()
        self.connector = connector
        self.pool = pool
        self.board = board
        self.report = report
        live = self._settings  # one holder for all of them: a reload changes it once
        milestones = Milestones(live, board, report)
        relay = Relay(live, board, report, milestones, self.silence)
        attempts = Attempts(
            live,
            connector,
            pool,
            queue,
            report,
            milestones,
            relay.commit_and_relay,
            self.silence,
            engines,
        )
        self._attempts = attempts
        self._milestones = milestones
        self._relay = relay
        # The clients' priorities and rpm/tpm windows (docs/sharing.md).
        self.shares = ClientShares(live)

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    @property
    def attempts(self) -> Attempts:
        """The attempts' runner (the proxy sets its ``fleet`` step with a shared state)."""
        return self._attempts

    async def run(
        self,
        client: ClientConnection,
        request: ClientRequest,
        client_address: str | None = None,
        scheme: str = "http",
        *,
        client_name: str = ANONYMOUS,
    ) -> bool:
        """Serve one request: attempts, failover, relay. Returns keep-alive.

        ``client_name`` is the request's client (``ClientGate``): the name of
        the key it presented, else the client header's value, else
        ``anonymous``.
        """
        now = trio.current_time()
        self.board.expire(now)
        shares = self.shares
        work = Workload(
            id=workload_id(request.headers),
            method=request.method.decode("ascii", "replace"),
            path=request.target.split(b"?", 1)[0].decode("ascii", "replace"),
            started=now,
            client=client_name,
            priority=shares.rank(client_name, request.headers),
        )
        plan = self._attempts.plan(request, client_address, scheme)
        model = plan.model
        # Shown in /status and the events: a client's megabyte of "model" is not.
        work.name(model if model is None or len(model) <= MODEL_SHOWN else model[:MODEL_SHOWN])
        self.report.started(work, request, plan.document, client_address, scheme)

        keep_alive = False
        settled = trio.Event()
        try:
            retry_after = (
                shares.admit(client_name, now)
                if shares.fleet is None
                else await shares.admit_fleet(client_name, now)  # the fleet's windows
            )
            if retry_after is not None:  # over its rpm or tpm: nothing goes to a node
                await self._rate_limited(client, work, retry_after)
                return client.reusable
            try:
                async with trio.open_nursery() as nursery:
                    if self.config.client_close != "ignore":
                        nursery.start_soon(
                            self._watch_client, client, work, nursery.cancel_scope, settled
                        )
                    try:
                        keep_alive = await self._attempts.serve(client, work, plan)
                    finally:
                        settled.set()  # the watcher returns (no Cancelled to raise and catch)
            except Exception:
                # The one place that turns an unexpected failure into an answer:
                # the process keeps serving other connections.
                logger.exception("internal error", extra={"fields": {"id": work.id}})
                if work.state not in FINAL:
                    work.finish(State.FAILED)
                if work.committed_at is None:
                    await send_failure(client, work, 502, "internal_error", "internal proxy error")
                keep_alive = False
        except BaseException:
            # Cancelled from outside the workload: the end of a drain's
            # --shutdown-timeout, or serve() cancelled. It still ends with
            # its terminal event and access line; then the cancellation goes on.
            await self._cut_by_shutdown(client, work)
            self.report.finish(work)
            raise
        if work.client_left is not None and work.state not in FINAL:
            self._milestones.client_aborted(work)
            keep_alive = False
        try:
            if shares.fleet is None:  # its tokens, for its client's tpm
                shares.charge(work, trio.current_time())
            else:
                await shares.charge_fleet(work, trio.current_time())
        finally:
            self.report.finish(work)
        return keep_alive and client.reusable

    async def _rate_limited(self, client: ClientConnection, work: Workload, seconds: int) -> None:
        """Answer ``429 rate_limited``: the client's last minute holds its rpm or tpm."""
        self.report.publish_workload(work)
        work.finish(State.FAILED)
        message = f"client {work.client} is over its rate limit; retry in {seconds} s"
        await send_failure(
            client, work, 429, "rate_limited", message, ((b"retry-after", b"%d" % seconds),)
        )
        self.report.finish(work)

    async def _cut_by_shutdown(self, client: ClientConnection, work: Workload) -> None:
        """Settle a workload that the proxy's stop cancelled: ``cancelled``, reason ``shutdown``.

        The attempt in flight, if any, gets the outcome ``shutdown``. A
        client that was sent nothing yet gets ``503 shutting_down`` (as a
        workload still in the queue does at the drain's start), within
        ``SHUTDOWN_ANSWER_TIMEOUT``; a committed stream is only cut.

        Cancellation: runs inside the cancellation it reports, shielded
        for at most ``SHUTDOWN_ANSWER_TIMEOUT``.
        """
        if work.state in FINAL:
            return
        if work.node is not None and len(work.attempts) < work.attempt:
            elapsed = trio.current_time() - work.attempt_started
            detail = "the proxy stopped (end of the drain)"
            record = AttemptRecord(work.node, Outcome.SHUTDOWN, elapsed, detail=detail)
            work.record(record)
            self.report.metrics.attempt_ended(record.node, str(record.outcome))
        work.finish(State.CANCELLED, Outcome.SHUTDOWN.value)
        if work.committed_at is None:
            code, message = REFUSALS["shutdown"]
            with trio.move_on_after(SHUTDOWN_ANSWER_TIMEOUT, shield=True):
                await send_failure(client, work, 503, code, message)

    async def _watch_client(
        self,
        client: ClientConnection,
        work: Workload,
        workload_scope: trio.CancelScope,
        settled: trio.Event,
    ) -> None:
        """Cancel the workload when the client leaves; return once it is ``settled``.

        The body sets ``settled`` when it is done and the client's reader sets
        it when the client's side ends. Ending the watcher by a return, not by
        cancelling the nursery, spares every request a Cancelled exception,
        the nursery's exception group and the cancel scope's split of it.
        """
        how = client.closed
        if how is None:
            client.watch(settled)
            try:
                await settled.wait()
            finally:
                client.watch(None)
            how = client.closed
            if how is None:
                return  # the workload is done
        if how is Closed.EOF and self.config.client_close == "rst-only":
            return  # a half-closed client still waits for its answer
        work.client_left_by(how)
        workload_scope.cancel()
