"""The attempts of one workload: candidates, slots, failover, the final answer.

``Attempts.serve`` is the body of a workload's nursery (``workload.py``):
it takes a slot on the next candidate (``take_slot``, from ``queue.py``'s
``SlotQueue``), sends the
request as that node gets it, and either hands a committed response to the
relay or executes the failure's verdict (``milestones.py``) and moves on.
When no node is left it answers itself (``answers.py``). The order of the
candidates comes from ``core/ranking.py``, the request a node gets from
``core/rewrite.py`` and ``core/headers.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..core.config import Config, Upstream
from ..core.errors import RetryableResponse, UpstreamError
from ..core.headers import get, upstream_request_headers
from ..core.outcome import SavedResponse, failure_code, failure_status
from ..core.ranking import affinity_key, resolve_candidates
from ..core.requests import is_unstreamed, request_model
from ..core.rewrite import node_body, node_target
from ..core.slots import Exhausted, Granted, QueueBudget, QueueFull, Slot
from ..core.workload import State
from ..wire.client import ClientConnection, ClientRequest
from ..wire.pool import ConnectionPool
from ..wire.upstream import Connector, Liveness, OutgoingRequest, UpstreamResponse, open_response
from .answers import send_failure, send_saved, turn_away
from .milestones import Milestones
from .queue import SlotQueue
from .records import Workload
from .report import Report

# Commit a response and stream it to the client; True: relayed to its end.
Relay = Callable[[ClientConnection, Workload, Upstream, UpstreamResponse], Awaitable[bool]]


class Attempts:
    """Tries the candidates of a workload one after another."""

    def __init__(
        self,
        config: Config,
        connector: Connector,
        pool: ConnectionPool,
        queue: SlotQueue,
        report: Report,
        milestones: Milestones,
        relay: Relay,
        liveness: Liveness | None = None,
    ) -> None:
        self.config = config
        # Asks a node that keeps an attempt waiting whether it is alive (SPEC 5.5).
        self.liveness = liveness
        self.connector = connector
        self.pool = pool
        self.queue = queue
        self.report = report
        self.milestones = milestones
        self.relay = relay

    def candidates(
        self, request: ClientRequest, document: Any
    ) -> tuple[list[Upstream], str | None]:
        """The candidates in resolved order, and the node resolution put first (or None).

        Not partitioned here: the slot queue asks ``NodeBoard.is_demoted`` at
        each attempt (``slots.choose_node``), so a node that recovers while
        a workload waits or fails over regains its place.
        """
        header = get(request.headers, b"x-failover-node")
        selected = header.decode("latin-1") if header else None
        key = affinity_key(document) if self.config.affinity == "prefix" else None
        candidates = resolve_candidates(
            self.config.upstreams,
            model=request_model(document),
            is_cooling=_never,
            selected=selected,
            affinity_key=key,
            inventories=self.milestones.board.inventories,
        )
        first = candidates[0].name if candidates else None
        preferred = (
            first if key is not None or (selected is not None and first == selected) else None
        )
        return candidates, preferred

    async def serve(
        self,
        client: ClientConnection,
        request: ClientRequest,
        work: Workload,
        candidates: list[Upstream],
        preferred: str | None,
        document: Any,
        client_address: str | None,
        scheme: str,
    ) -> bool:
        """Run the attempts and answer the client; returns keep-alive."""
        if not candidates:
            self.report.publish_workload(work)
            work.state, work.status = State.FAILED, 404
            message = f"no node serves model {document.get('model')!r}"
            await send_failure(client, work, 404, "model_not_found", message)
            return True
        nodes = {node.name: node for node in candidates}
        order = list(nodes)
        limit = min(self.config.max_attempts or len(order), len(order))
        tried: set[str] = set()
        last_answer: SavedResponse | None = None
        while len(tried) < limit:
            # Before the first attempt no checkpoint has passed since the
            # workload began (the clock still reads work.started); after a
            # failed one it has.
            now = work.started if not tried else trio.current_time()
            slot = await take_slot(self.queue, self.report, work, order, tried, preferred, now)
            if isinstance(slot, str):
                return await turn_away(client, work, self.report, slot)
            if slot is None:
                break
            # The slot is held from here to the end of the relay and given
            # back exactly once, whatever ends the attempt. A failure is
            # judged before that, so the workload handed the slot sees the
            # node already cooling if this attempt cooled it.
            try:
                node = nodes[slot.node]
                tried.add(node.name)
                work.node, work.attempt_started, work.state = (
                    node.name,
                    trio.current_time(),
                    State.RUNNING,
                )
                work.attempt = len(tried)
                outgoing = request_for(node, request, work, document, client_address, scheme)
                self.report.attempt_started(work, node, outgoing)  # event; span, traceparent
                try:
                    response = await open_response(
                        node,
                        outgoing,
                        connector=self.connector,
                        config=self.config,
                        pool=self.pool,
                        started=work.attempt_started,
                        liveness=self.liveness,
                    )
                except UpstreamError as failure:
                    if isinstance(failure, RetryableResponse) and failure.saved is not None:
                        last_answer = failure.saved
                    last = len(tried) == limit
                    moving_on = self.milestones.attempt_failed(work, node, failure, last=last)
                else:
                    return await self.relay(client, work, node, response)
            finally:
                self.queue.release(slot)
            if not moving_on:
                break
        work.state = State.FAILED
        if last_answer is not None:
            work.status = last_answer.status
            return await send_saved(client, work, last_answer)
        status = failure_status(work.attempts)
        await send_failure(client, work, status, failure_code(status), "every node failed")
        return True


def request_for(
    node: Upstream,
    request: ClientRequest,
    work: Workload,
    document: Any,
    client_address: str | None,
    scheme: str,
) -> OutgoingRequest:
    """The request as ``node`` gets it: its target, model name and headers."""
    body = node_body(request.body, document, node)
    carries_body = bool(body) or request.method in (b"POST", b"PUT", b"PATCH")
    headers = upstream_request_headers(
        request.headers,
        host=node.host_header,
        request_id=work.id,
        client_address=client_address,
        client_scheme=scheme,
        node_headers=node.headers,
        content_length=len(body) if carries_body else None,
    )
    target = node_target(request.target, node.base_path)
    return OutgoingRequest(
        method=request.method,
        target=target,
        headers=headers,
        body=body,
        unstreamed=is_unstreamed(work.path, document),
    )


async def take_slot(
    queue: SlotQueue,
    report: Report,
    work: Workload,
    order: list[str],
    tried: set[str],
    preferred: str | None,
    now: float | None = None,
) -> Slot | str | None:
    """A slot for the workload's next attempt, at once or after waiting in the queue.

    Publishes the workload's ``queued`` event: a plain one before its first
    attempt if it never waits, one with ``position`` each time it waits.

    ``now``: the Trio clock, if read since the caller's last checkpoint.

    Returns:
        The slot; None when every candidate was tried; else why the queue
        turned the workload away (a key of ``queue.REFUSALS``).

    Cancellation: a waiting workload leaves the queue (the client left).
    """
    result = queue.acquire(order, tried=tried, preferred=preferred, now=now)
    if isinstance(result, Granted | QueueFull | Exhausted):
        if work.attempt == 0:
            report.publish_workload(work)
        if isinstance(result, Granted):
            return result.slot
        return "queue_full" if isinstance(result, QueueFull) else None
    waiter = result.waiter
    if work.state is not State.QUEUED:
        work.state = State.QUEUED  # failed over into a full fleet
    started = trio.current_time()
    work.node, work.queued_since = None, started
    report.publish_workload(work, position=waiter.position)
    # One budget for all of a workload's waits; no node deadline runs.
    budget = QueueBudget(report.config.queue_timeout, work.waited)
    try:
        slot = await queue.wait(waiter, budget.deadline(started))
    finally:
        report.waited(work, started, trio.current_time())
    if slot is not None:
        return slot
    return "shutdown" if queue.closed else "queue_timeout"


def _never(_node: str) -> bool:
    return False
