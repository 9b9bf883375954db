"""The attempts of one workload: candidates, slots, failover, the final answer.

``Attempts.serve`` is the body of a workload's nursery (``workload.py``):
it takes a slot on the next candidate (``take_slot``, from ``queue.py``'s
``SlotQueue``), sends the
request as that node gets it, and either hands a committed response to the
relay or executes the failure's verdict (``milestones.py``) and moves on.
When no node is left it answers itself (``answers.py``). The order of the
candidates comes from ``core/ranking.py``, the request a node gets from
``core/requests.py`` and ``core/headers.py``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import attrs
import trio

from ...core.config import Config, LiveConfig, Upstream, live_config
from ...core.engine_book import EngineBook
from ...core.errors import RetryableResponse, Unresponsive, UpstreamError
from ...core.headers import get, upstream_request_headers
from ...core.liveness import question_period
from ...core.outcome import SavedResponse, failure_code, failure_status
from ...core.ranking import resolve_candidates
from ...core.requests import (
    is_unstreamed,
    node_body,
    node_target,
    request_document,
    request_model,
)
from ...core.slots import Exhausted, Granted, QueueBudget, QueueFull, Slot
from ...core.workload import State
from ...wire.client import ClientConnection, ClientRequest
from ...wire.pool import ConnectionPool
from ...wire.upstream import (
    Connector,
    OutgoingRequest,
    UpstreamResponse,
    head_timed_out,
    head_wait,
    open_response,
)
from ..nodes.affinity import Affine, CacheAffinity
from ..nodes.queue import SlotQueue
from ..nodes.silence import SilenceTimer, SilenceWatch
from ..records import Workload
from ..report import Report
from .answers import send_failure, send_saved, turn_away
from .milestones import Milestones


@attrs.frozen
class Plan:
    """What one workload asks and where it may go, built once (``Attempts.plan``)."""

    request: ClientRequest
    document: Any  # the JSON body, parsed once (``requests.request_document``)
    model: str | None  # its "model", whole (the workload's summary shortens it)
    candidates: list[Upstream]  # resolved order, not split by readiness
    preferred: str | None  # the node resolution put first (selection, affinity), if any
    client_address: str | None
    scheme: str
    affine: Affine | None = None  # its prompt's chain, with cache affinity on
    pinned: bool = False  # ``preferred`` is the client's ``X-Failover-Node``


# What ``take_slot`` returns for a waiter a reload took out of the queue.
MOVED = "moved"


class FleetSlots(Protocol):
    """The slot leases across replicas (``fleet.FleetSlots``); None with ``memory``."""

    async def take(self, node: str) -> str | None: ...  # None: full across the fleet

    async def release(self, node: str, lease: str) -> None: ...

    async def queued(self, nodes: Iterable[str]) -> None: ...  # a workload waits for them


# Commit a response and stream it to the client; True: relayed to its end.
# The int: the size of the request's body (a stream's estimated prompt tokens).
Relay = Callable[[ClientConnection, Workload, Upstream, UpstreamResponse, int], Awaitable[bool]]


class Attempts:
    """Tries the candidates of a workload one after another."""

    # The fleet step: set by the proxy with ``--state redis://``.
    fleet: FleetSlots | None = None
    # Cache affinity's memory and counts: set by the proxy (None: a bare runner).
    affinity: CacheAffinity | None = None

    def __init__(
        self,
        config: Config | LiveConfig,
        connector: Connector,
        pool: ConnectionPool,
        queue: SlotQueue,
        report: Report,
        milestones: Milestones,
        relay: Relay,
        silence: SilenceWatch,
        engines: EngineBook | None = None,
    ) -> None:
        self._settings = live_config(config)
        # The engines' signals: loaded models first; None = none.
        self.engines = engines
        # Times each attempt's wait for its node: a silent node is asked
        # whether it is alive, and a node found down ends the attempt.
        self.silence = silence
        self.connector = connector
        self.pool = pool
        self.queue = queue
        self.report = report
        self.milestones = milestones
        self.relay = relay

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def plan(self, request: ClientRequest, client_address: str | None, scheme: str) -> Plan:
        """The workload's plan: its request parsed once, and its candidates in resolved order.

        Not partitioned here: the slot queue asks ``NodeBoard.is_demoted`` at
        each attempt (``slots.choose_node``), so a node that recovers while
        a workload waits or fails over regains its place.
        """
        # Parsed for every request: whether it streams picks the head
        # deadline. Only a body that starts with "{" is parsed.
        document = request_document(request.body)
        model = request_model(document)
        header = get(request.headers, b"x-failover-node")
        selected = header.decode("latin-1") if header else None
        candidates = resolve_candidates(
            self.config.upstreams,
            model=model,
            selected=selected,
            inventories=self.milestones.board.inventories,
        )
        first = candidates[0].name if candidates else None
        preferred = first if selected is not None and first == selected else None
        affine = None
        pinned = preferred is not None
        if self.affinity is not None and self.config.affinity == "prefix":
            affine = self.affinity.choose(document, candidates, self.queue)
            if preferred is None and affine is not None:  # X-Failover-Node wins over it
                preferred = affine.preferred
        return Plan(
            request, document, model, candidates, preferred, client_address, scheme, affine, pinned
        )

    async def serve(self, client: ClientConnection, work: Workload, plan: Plan) -> bool:
        """Run the attempts of ``plan`` and answer the client; returns keep-alive."""
        candidates, preferred = plan.candidates, plan.preferred
        if not candidates:
            return await self._no_node(client, work, plan.model)
        nodes = {node.name: node for node in candidates}
        order = list(nodes)
        limit = min(self.config.max_attempts or len(order), len(order))
        tried: set[str] = set()
        last_answer: SavedResponse | None = None
        engines = self.engines
        loaded: frozenset[str] = frozenset()
        if engines is not None and engines.signals:  # nothing to ask without
            loaded = engines.loaded(plan.model)
            if loaded and plan.pinned and preferred is not None:
                # The client's choice of node stands before the nodes that
                # hold the model loaded (while it has a free slot).
                loaded |= {preferred}
        resolved, first = self.config, True
        while len(tried) < limit:
            if self.config is not resolved:  # a reload: the same request, the new node list
                resolved = self.config
                fresh_plan = self.plan(plan.request, plan.client_address, plan.scheme)
                fresh, preferred = fresh_plan.candidates, fresh_plan.preferred
                if not fresh and not tried:
                    return await self._no_node(client, work, plan.model)
                nodes = {node.name: node for node in fresh}
                order = list(nodes)
                limit = len(tried) + sum(name not in tried for name in order)
                limit = min(resolved.max_attempts or limit, limit)
                continue
            # Before the first attempt no checkpoint has passed since the
            # workload began (the clock still reads work.started); after a
            # failed one, or a wait, it has.
            now = work.started if first else trio.current_time()
            first = False
            slot = await take_slot(
                self.queue, self.report, work, order, tried, preferred, now, loaded, self.fleet
            )
            if slot == MOVED:  # taken out of the queue by a reload: resolved again above
                continue
            if isinstance(slot, str):
                return await turn_away(client, work, self.report, slot)
            if slot is None:
                break
            lease = None
            if self.fleet is not None:  # the node's slot across the replicas, too
                lease = await self.fleet.take(slot.node)
                if lease is None:  # full elsewhere: the slot back, and wait in the queue
                    self.queue.release(slot)
                    continue
            # The slot is held from here to the end of the relay and given
            # back exactly once, whatever ends the attempt. A failure is
            # judged before that, so the workload handed the slot sees the
            # node already cooling if this attempt cooled it.
            try:
                node = nodes[slot.node]
                tried.add(node.name)
                work.begin_attempt(node.name, trio.current_time(), len(tried))
                outgoing = request_for(node, plan, work)
                if engines is not None and engines.signals:  # a cold load
                    cold = engines.head_timeout(node.name, plan.model)
                    if cold != self.config.response_header_timeout:
                        outgoing = attrs.evolve(outgoing, head_timeout=cold)
                self.report.attempt_started(work, node, outgoing)  # event; span, traceparent
                try:
                    response = await self._attempt(node, outgoing, work)
                except UpstreamError as failure:
                    if isinstance(failure, RetryableResponse) and failure.saved is not None:
                        last_answer = failure.saved
                    last = len(tried) == limit
                    moving_on = self.milestones.attempt_failed(work, node, failure, last=last)
                else:
                    if plan.affine is not None and response.status < 400:
                        assert self.affinity is not None
                        self.affinity.served(work, node.name, plan.affine)  # its home now
                    return await self.relay(client, work, node, response, len(plan.request.body))
            finally:
                if lease is not None:
                    assert self.fleet is not None
                    await self.fleet.release(slot.node, lease)
                self.queue.release(slot)
            if not moving_on:
                break
        work.finish(State.FAILED)
        if last_answer is not None:
            work.answered(last_answer.status)
            return await send_saved(client, work, last_answer)
        status = failure_status(work.attempts)
        await send_failure(client, work, status, failure_code(status), "every node failed")
        return True

    async def _attempt(
        self, node: Upstream, outgoing: OutgoingRequest, work: Workload
    ) -> UpstreamResponse:
        """One attempt up to commit, its silence timed: a node found down ends it.

        The timer's scope is the attempt's one cancel scope: the watch
        cancels it when the node is found down, and the wire sets the head's
        deadline on it (``upstream.Progress``).

        Raises:
            UpstreamError: the attempt failed; ``Unresponsive`` when the
                node was found down (no answer to a liveness check, or a
                down mark from any check) while the attempt waited on it;
                ``HeaderTimeout`` when the head's deadline passed.
        """
        config = self.config
        interval, timeout = config.liveness_interval, config.response_header_timeout
        head_timeout = head_wait(outgoing, config)
        timer = SilenceTimer(
            math.inf,
            armed=False,
            node=node.name,
            committed=False,
            head_period=question_period(interval, timeout, watched=outgoing.unstreamed),
            period=question_period(interval, timeout, watched=not config.first_body_timeout),
            deadlines=(head_timeout, config.first_body_timeout or math.inf),
        )
        self.silence.register(timer)
        try:
            with timer.scope:
                try:
                    response = await open_response(
                        node,
                        outgoing,
                        connector=self.connector,
                        config=config,
                        pool=self.pool,
                        started=work.attempt_started,
                        progress=timer,
                    )
                except UpstreamError as error:
                    error.checks += timer.checks
                    raise
                response.checks += timer.checks
                return response
        finally:
            self.silence.unregister(timer)
            if timer.resends:  # a pooled connection found stale: told, not hidden
                work.asked(0, timer.resends)
                self.report.resent(node.name, timer.resends)
        # The watch cancels the scope only for a node found down, and says
        # why (ended_by); otherwise the head's deadline, set on it, passed.
        failure: UpstreamError
        if timer.ended_by is None:
            failure = head_timed_out(node.name, head_timeout)
        else:
            phase = "first body byte" if timer.head_seen else "head"
            failure = Unresponsive(node.name, phase, timer.ended_by)
        failure.checks += timer.checks
        raise failure

    async def _no_node(self, client: ClientConnection, work: Workload, model: str | None) -> bool:
        self.report.publish_workload(work)
        work.finish(State.FAILED)
        work.answered(404)
        message = f"no node serves model {model!r}"
        await send_failure(client, work, 404, "model_not_found", message)
        return True


def request_for(node: Upstream, plan: Plan, work: Workload) -> OutgoingRequest:
    """The request of ``plan`` as ``node`` gets it: its target, model name and headers."""
    request, document = plan.request, plan.document
    body = node_body(request.body, document, node)
    carries_body = bool(body) or request.method in (b"POST", b"PUT", b"PATCH")
    headers = upstream_request_headers(
        request.headers,
        host=node.host_header,
        request_id=work.id,
        client_address=plan.client_address,
        client_scheme=plan.scheme,
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
    loaded: frozenset[str] = frozenset(),
    fleet: FleetSlots | None = None,
) -> Slot | str | None:
    """A slot for the workload's next attempt, at once or after waiting in the queue.

    Publishes the workload's ``queued`` event: a plain one before its first
    attempt if it never waits, one with ``position`` each time it waits.

    ``now``: the Trio clock, if read since the caller's last checkpoint.
    ``loaded``: the nodes holding the request's model loaded.
    ``fleet``: the replicas' slots, told when the workload waits.

    Returns:
        The slot; None when every candidate was tried; ``MOVED`` when a
        reload took it out of the queue; else why the queue turned the
        workload away (a key of ``queue.REFUSALS``).

    Cancellation: a waiting workload leaves the queue (the client left).
    """
    result = queue.acquire(
        order,
        tried=tried,
        preferred=preferred,
        now=now,
        loaded=loaded,
        model=work.model,
        client=work.client,
        rank=work.priority,
    )
    if isinstance(result, Granted | QueueFull | Exhausted):
        if work.attempt == 0:
            report.publish_workload(work)
        if isinstance(result, Granted):
            return result.slot
        return "queue_full" if isinstance(result, QueueFull) else None
    waiter = result.waiter
    started = trio.current_time()
    work.wait_in_queue(started)  # again, if it failed over into a full fleet
    report.publish_workload(work, position=waiter.position)
    if fleet is not None:
        try:
            await fleet.queued(node for node in order if node not in tried)
        except BaseException:
            queue.leave(waiter)  # cancelled before its wait: out of the queue all the same
            raise
    # One budget for all of a workload's waits; no node deadline runs.
    budget = QueueBudget(report.config.queue_timeout, work.waited)
    try:
        slot = await queue.wait(waiter, budget.deadline(started))
    finally:
        ended = trio.current_time()
        work.stop_waiting(ended)
        report.waited(work, started, ended)
    if slot is not None:
        return slot
    if waiter.moved:  # a reload changed the nodes: resolve the candidates again
        return MOVED
    if waiter.displaced:  # a newcomer of a higher priority took its place
        return "queue_full"
    return "shutdown" if queue.closed else "queue_timeout"
