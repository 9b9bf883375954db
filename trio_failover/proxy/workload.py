"""One workload: the nursery, the watcher, the attempts and the relay.

A workload runs in its own nursery. Its body tries the candidates one after
another and, after commit, relays the stream; beside it runs a watcher of
the client connection. Whichever settles the workload cancels the other:
the body when it is done, the watcher when the client leaves (FIN or RST,
per ``--client-close``). Cancelling an attempt closes its upstream socket at
once (``upstream.open_response`` does it in ``finally``).

Decisions (candidate order, failover, cooldown, the request for a node) come
from the pure core (``ranking``, ``outcome``, ``rewrite``); this module
executes them and tells ``Report`` what happened.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import h11
import trio

from ..core.answers import error_document, error_headers
from ..core.config import Config, Upstream
from ..core.errors import RetryableResponse, UpstreamError
from ..core.headers import client_response_headers, get, upstream_request_headers
from ..core.outcome import (
    AttemptRecord,
    Outcome,
    SavedResponse,
    after_commit,
    failure_code,
    failure_status,
    judge,
    may_pool,
    retry_after_of,
)
from ..core.ranking import affinity_key, resolve_candidates
from ..core.requests import is_unstreamed, request_document, request_model, workload_id
from ..core.rewrite import node_body, node_target
from ..core.workload import FINAL, State
from ..service.logs import logger
from ..wire.client import ClientConnection, ClientGone, ClientRequest, Closed
from ..wire.pool import ConnectionPool
from ..wire.upstream import Connector, OutgoingRequest, UpstreamResponse, open_response
from .queue import REFUSALS, take_slot
from .report import Report, Workload
from .silence import SilenceTimer


class WorkloadRunner:
    """Runs each request of a client connection as one workload."""

    def __init__(
        self, config: Config, connector: Connector, pool: ConnectionPool, report: Report
    ) -> None:
        self.config = config
        self.connector = connector
        self.pool = pool
        self.report = report

    async def run(
        self,
        client: ClientConnection,
        request: ClientRequest,
        client_address: str | None = None,
        scheme: str = "http",
        *,
        client_name: str | None = None,
    ) -> bool:
        """Serve one request: attempts, failover, relay. Returns keep-alive.

        ``client_name`` is the name of the client key the request presented
        (``ClientGate``), None when no key is configured.
        """
        now = trio.current_time()
        self.report.expire_cooldowns(now)
        work = Workload(
            id=workload_id(request.headers),
            method=request.method.decode("ascii", "replace"),
            path=request.target.split(b"?", 1)[0].decode("ascii", "replace"),
            started=now,
            client=client_name,
        )
        # Parsed for every request: whether it streams picks the head
        # deadline (SPEC 5.5). Only a body that starts with "{" is parsed.
        document = request_document(request.body)
        candidates, preferred = self._candidates(request, document)
        self.report.started(work)

        keep_alive = False
        settled = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                if self.config.client_close != "ignore":
                    nursery.start_soon(
                        self._watch_client, client, work, nursery.cancel_scope, settled
                    )
                try:
                    keep_alive = await self._serve(
                        client,
                        request,
                        work,
                        candidates,
                        preferred,
                        document,
                        client_address,
                        scheme,
                    )
                finally:
                    settled.set()  # the watcher returns (no Cancelled to raise and catch)
        except Exception:
            # The one place that turns an unexpected failure into an answer:
            # the process keeps serving other connections.
            logger.exception("internal error", extra={"fields": {"id": work.id}})
            if work.state not in FINAL:
                work.state = State.FAILED
            if work.committed_at is None:
                await self._send_failure(
                    client, work, 502, "internal_error", "internal proxy error"
                )
            keep_alive = False
        if work.client_left is not None and work.state not in FINAL:
            self._client_aborted(work)
            keep_alive = False
        self.report.finish(work)
        return keep_alive and client.reusable

    def _candidates(
        self, request: ClientRequest, document: Any
    ) -> tuple[list[Upstream], str | None]:
        """The candidates in resolved order, and the node resolution put first (or None).

        Not partitioned here: the slot queue asks ``Report.is_demoted`` at
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
            inventories=self.report.health.inventories,
        )
        first = candidates[0].name if candidates else None
        preferred = (
            first if key is not None or (selected is not None and first == selected) else None
        )
        return candidates, preferred

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
        work.client_left = how
        workload_scope.cancel()

    async def _serve(
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
        if not candidates:
            self.report.publish_workload(work)
            work.state, work.status = State.FAILED, 404
            message = f"no node serves model {document.get('model')!r}"
            await self._send_failure(client, work, 404, "model_not_found", message)
            return True
        nodes = {node.name: node for node in candidates}
        order = list(nodes)
        limit = min(self.config.max_attempts or len(order), len(order))
        tried: set[str] = set()
        last_answer: SavedResponse | None = None
        while len(tried) < limit:
            slot = await take_slot(self.report, work, order, tried, preferred)
            if isinstance(slot, str):
                return await self._turned_away(client, work, slot)
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
                self.report.publish_workload(work)
                outgoing = self._request_for(node, request, work, document, client_address, scheme)
                try:
                    response = await open_response(
                        node, outgoing, connector=self.connector, config=self.config, pool=self.pool
                    )
                except UpstreamError as failure:
                    if isinstance(failure, RetryableResponse) and failure.saved is not None:
                        last_answer = failure.saved
                    last = len(tried) == limit
                    moving_on = self._attempt_failed(work, node, failure, last=last)
                else:
                    return await self._commit_and_relay(client, work, node, response)
            finally:
                self.report.queue.release(slot)
            if not moving_on:
                break
        work.state = State.FAILED
        if last_answer is not None:
            work.status = last_answer.status
            return await self._send_saved(client, work, last_answer)
        status = failure_status(work.attempts)
        await self._send_failure(client, work, status, failure_code(status), "every node failed")
        return True

    async def _turned_away(self, client: ClientConnection, work: Workload, reason: str) -> bool:
        """Answer ``503`` for a workload the queue refused; nothing was sent for it."""
        code, message = REFUSALS[reason]
        work.state = State.FAILED
        self.report.turned_away(reason)
        await self._send_failure(client, work, 503, code, message)
        return True

    async def _commit_and_relay(
        self, client: ClientConnection, work: Workload, node: Upstream, response: UpstreamResponse
    ) -> bool:
        try:
            with self.report.health.streaming(node.name):  # a slow check then proves nothing
                relayed = await self._relay(client, work, node, response)
        except BaseException:
            await response.aclose()  # cancelled or failed: never pooled
            raise
        if may_pool(relayed=relayed, client_gone=client.closed is not None):
            await response.release()
        else:
            await response.aclose()
        return relayed

    async def _relay(
        self, client: ClientConnection, work: Workload, node: Upstream, response: UpstreamResponse
    ) -> bool:
        """Commit the response and stream the rest, chunk by chunk, unbuffered."""
        self._committed(work, node, response)
        headers = client_response_headers(
            response.headers,
            request_id=work.id,
            node=node.name,
            attempts=len(work.attempts) + 1,
            keep_length=True,
        )
        # _parsed: skip h11's header regexes, which these headers passed
        # already (the node's parsed by h11, the proxy's own checked at
        # configuration time; see headers.client_response_headers).
        commit: list[h11.Event] = [
            h11.Response(
                status_code=response.status, reason=response.reason, headers=headers, _parsed=True
            )
        ]
        if response.first_chunk:
            commit.append(h11.Data(data=response.first_chunk))
            work.body_bytes += len(response.first_chunk)
        if response.complete:
            commit.append(h11.EndOfMessage())
        idle_timeout = self.config.stream_idle_timeout or math.inf
        try:
            await client.send(*commit)
            if not await self._stream_rest(client, work, response, idle_timeout):
                self._stream_ended(work, node, Outcome.STREAM_IDLE_TIMEOUT, "stream went silent")
                return False
        except UpstreamError as exc:
            # After commit nothing is replayed: the client sees a truncated
            # response (no terminating chunk, or a short Content-Length body).
            self._stream_ended(work, node, after_commit(exc.outcome), str(exc))
            return False
        except ClientGone:
            if work.client_left is None:
                work.client_left = Closed.RESET
            if self.config.client_close == "ignore":
                await _drain_ignored(response, idle_timeout)
            return False
        self._stream_ended(work, node, Outcome.COMPLETED, "")
        return True

    async def _stream_rest(
        self,
        client: ClientConnection,
        work: Workload,
        response: UpstreamResponse,
        idle_timeout: float,
    ) -> bool:
        """Relay the body after the commit; False: the node went silent too long.

        The silence is timed by a ``SilenceTimer`` task beside the relay (one
        per stream, started only when a body remains and the timeout is on):
        no deadline is moved per chunk. It bounds only the waits for the
        node, not the writes to the client, whose pace is not the node's
        silence. In an event stream only a chunk that begins a line other
        than a comment or a blank one ends a silence (SPEC 5.6), and before
        the first such line the timer is not armed: the wait is still the
        first-body wait, unbounded (a long prefill with pings is never cut,
        an engine that only pings after its first token is).
        """
        timer = SilenceTimer(idle_timeout, armed=response.progressed)
        if response.complete or idle_timeout == math.inf:
            await self._relay_chunks(client, work, response, timer)
            return True
        failure: UpstreamError | ClientGone | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer.run)
            try:
                await self._relay_chunks(client, work, response, timer)
            except (UpstreamError, ClientGone) as exc:
                failure = exc  # raised below, outside the nursery's exception group
            finally:
                timer.stop()
        if failure is not None:
            raise failure
        return not timer.fired

    async def _relay_chunks(
        self,
        client: ClientConnection,
        work: Workload,
        response: UpstreamResponse,
        timer: SilenceTimer,
    ) -> None:
        """The relay loop: read from the node, write to the client, note the silence."""
        scanner = response.scanner
        with timer.scope:
            while not response.complete:
                timer.waiting_since = waited = trio.current_time()
                chunk = await response.receive_chunk()
                if timer.scope.cancel_called:
                    return  # the timer fired as the chunk came: the deadline passed
                timer.waiting_since = None
                work.body_bytes += len(chunk)
                if scanner is None or scanner.first_event_line(chunk) is not None:
                    timer.silence, timer.armed = 0.0, True
                else:  # a comment or a blank line: the node's silence runs on
                    timer.silence += trio.current_time() - waited
                    if timer.armed and timer.silence >= timer.timeout:
                        timer.scope.cancel()  # it came at the deadline, too late
                        return
                if not response.complete:
                    await client.send_data(chunk)
                elif chunk:  # the last bytes and the end in one write
                    await client.send(h11.Data(data=chunk), h11.EndOfMessage())
                else:
                    await client.send(h11.EndOfMessage())

    def _request_for(
        self,
        node: Upstream,
        request: ClientRequest,
        work: Workload,
        document: Any,
        client_address: str | None,
        scheme: str,
    ) -> OutgoingRequest:
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

    # -- answers that are not a node's stream --------------------------------

    async def _send_saved(
        self, client: ClientConnection, work: Workload, saved: SavedResponse
    ) -> bool:
        """Relay the last retryable answer as the node sent it (SPEC 5.7)."""
        headers = client_response_headers(
            saved.headers,
            request_id=work.id,
            node=saved.node,
            attempts=len(work.attempts),
            keep_length=False,
        )
        headers.append((b"content-length", b"%d" % len(saved.body)))
        try:
            await client.send(
                h11.Response(status_code=saved.status, reason=saved.reason, headers=headers),
                h11.Data(data=saved.body),
                h11.EndOfMessage(),
            )
        except ClientGone:
            return False
        work.body_bytes += 0 if work.method == "HEAD" else len(saved.body)
        return True

    async def _send_failure(
        self,
        client: ClientConnection,
        work: Workload,
        status: int,
        code: str,
        message: str,
    ) -> None:
        work.status = status
        attempts = [record.to_json() for record in work.attempts]
        # Ollama's shape under /api/, OpenAI's elsewhere (SPEC 5.7).
        document = error_document(work.path, status, code, message, attempts)
        headers = [
            (b"x-request-id", work.id.encode()),
            (b"x-failover-attempts", b"%d" % len(work.attempts)),
            *error_headers(code),
        ]
        with contextlib.suppress(ClientGone, h11.LocalProtocolError):
            # The access line's bytes count the proxy's own bodies too.
            work.body_bytes += await client.send_json(status, document, headers)

    # -- milestones: execute the verdict, tell the report --------------------

    def _attempt_failed(
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
        self.report.attempt_failed(work, record, moving_on=verdict.fail_over and not last)
        if verdict.cooldown > 0:
            self.report.demote(node.name, verdict.cooldown, str(failure.outcome), now)
        if verdict.recheck:
            self.report.health.ask_recheck(node.name)
        return verdict.fail_over

    def _committed(self, work: Workload, node: Upstream, response: UpstreamResponse) -> None:
        now = trio.current_time()
        work.committed_at = now
        work.state = State.COMMITTED
        work.status = response.status
        timings = response.timings
        self.report.committed(work, node.name, timings.head - timings.written, now)

    def _stream_ended(self, work: Workload, node: Upstream, outcome: Outcome, detail: str) -> None:
        now = trio.current_time()
        record = AttemptRecord(node.name, outcome, now - work.attempt_started, work.status, detail)
        work.state = State.COMPLETED if outcome is Outcome.COMPLETED else State.FAILED
        self.report.stream_ended(work, record)
        verdict = judge(outcome, response_header_timeout=self.config.response_header_timeout)
        if verdict.cooldown > 0:
            self.report.demote(node.name, verdict.cooldown, str(outcome), now)

    def _client_aborted(self, work: Workload) -> None:
        record = None
        if work.node is not None:
            detail = f"client {work.client_left.value if work.client_left else 'left'}"
            elapsed = trio.current_time() - work.attempt_started
            record = AttemptRecord(work.node, Outcome.CLIENT_ABORT, elapsed, detail=detail)
        work.state = State.CANCELLED
        self.report.client_aborted(work, record)


def _never(_node: str) -> bool:
    return False


async def _drain_ignored(response: UpstreamResponse, idle_timeout: float) -> None:
    """``--client-close ignore``: let the node finish although nobody listens."""
    while not response.complete:
        with trio.move_on_after(idle_timeout) as idle:
            try:
                await response.receive_chunk()
            except UpstreamError:
                return
        if idle.cancelled_caught:
            return
