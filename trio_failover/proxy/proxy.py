"""One client connection, one workload at a time: the nursery, the watcher,
the attempts and the relay.

A workload runs in its own nursery. Its body tries the candidates one after
another and, after commit, relays the stream; beside it runs a watcher of
the client connection. Whichever settles the workload cancels the other:
the body when it is done, the watcher when the client leaves (FIN or RST,
per ``--client-close``). Cancelling an attempt closes its upstream socket at
once (``upstream.open_response`` does it in ``finally``).

Decisions (candidate order, failover, cooldown) come from the pure modules
``ranking``, ``outcome`` and ``cooldown``; this module executes them and
reports what happened (events, metrics, logs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections import deque
from functools import partial
from typing import Any

import attrs
import h11
import trio

from .. import __version__
from ..core.config import Config, Upstream, redact_url
from ..core.cooldown import CooldownTable
from ..core.errors import ClientError, RetryableResponse, UpstreamError
from ..core.headers import client_response_headers, get, upstream_request_headers, workload_id
from ..core.outcome import (
    AttemptRecord,
    Outcome,
    SavedResponse,
    failure_status,
    judge,
    parse_retry_after,
)
from ..core.ranking import affinity_key, resolve_candidates
from ..service.events import EventBus
from ..service.logs import access_logger, log_access, logger
from ..service.metrics import Metrics
from ..wire.client import ClientConnection, ClientGone, ClientRequest, Closed
from ..wire.pool import ConnectionPool
from ..wire.upstream import (
    Connector,
    OutgoingRequest,
    TCPConnector,
    UpstreamResponse,
    open_response,
)

RECENT_WORKLOADS = 50


@attrs.define
class NodeStats:
    """Counters of one node, as ``/status`` shows them."""

    in_flight: int = 0
    served: int = 0
    failed: int = 0


@attrs.define
class Workload:
    """One client request across all its attempts."""

    id: str
    method: str
    path: str
    started: float
    attempts: list[AttemptRecord] = attrs.Factory(list)
    node: str | None = None  # the node of the current (or serving) attempt
    attempt: int = 0  # the number of the current attempt, from 1
    attempt_started: float = 0.0
    committed_at: float | None = None
    state: str = "queued"
    status: int | None = None
    body_bytes: int = 0
    client_left: Closed | None = None

    def summary(self, now: float) -> dict[str, Any]:
        """The JSON form used by events, ``/status`` and the dashboard."""
        return {
            "id": self.id,
            "method": self.method,
            "path": self.path,
            "state": self.state,
            "status": self.status,
            "node": self.node,
            "attempts": [record.to_json() for record in self.attempts],
            "ttfb_ms": (
                _ms(self.committed_at - self.started) if self.committed_at is not None else None
            ),
            "duration_ms": _ms(now - self.started),
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


class Proxy:
    """The failover proxy, independent of how client connections arrive.

    ``await proxy.handle_connection(stream)`` serves one client connection on
    any ``trio.abc.Stream``; ``server.serve`` feeds it accepted sockets, tests
    feed it in-memory streams (with a ``testing.MemoryConnector`` upstream).
    """

    def __init__(self, config: Config, *, connector: Connector | None = None) -> None:
        self.config = config
        self.connector: Connector = connector or TCPConnector(config)
        # Idle keep-alive connections to nodes; close with ``pool.aclose()``.
        self.pool = ConnectionPool(
            max_idle=config.pool_max_idle, idle_timeout=config.pool_idle_timeout
        )
        self.cooldowns = CooldownTable()
        self.events = EventBus()
        self.metrics = Metrics(node.name for node in config.upstreams)
        self.stats = {node.name: NodeStats() for node in config.upstreams}
        for name, stats in self.stats.items():
            # Read at scrape time: no gauge update per attempt.
            self.metrics.in_flight.labels(name).set_function(partial(getattr, stats, "in_flight"))
        # Finished workloads and when they ended; summarised only when asked.
        self._recent: deque[tuple[Workload, float]] = deque(maxlen=RECENT_WORKLOADS)
        self.draining = False
        self._idle_scopes: set[trio.CancelScope] = set()
        self._needs_body_json = config.affinity == "prefix" or any(
            node.models is not None for node in config.upstreams
        )

    # -- connections ---------------------------------------------------------

    async def handle_connection(
        self, stream: trio.abc.Stream, *, client_address: str | None = None, scheme: str = "http"
    ) -> None:
        """Serve one client connection until it closes; closes ``stream``."""
        config = self.config
        client = ClientConnection(
            stream,
            max_head=config.max_request_head,
            max_body=config.max_request_body,
            client_header_timeout=config.client_header_timeout,
            closing=lambda: self.draining,
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.run_reader)
                await self._serve_requests(client, client_address, scheme)
                nursery.cancel_scope.cancel()
        finally:
            await client.aclose()

    async def _serve_requests(
        self, client: ClientConnection, client_address: str | None, scheme: str
    ) -> None:
        while client.prepare_next():
            if not await self._wait_for_request(client):
                return
            try:
                request = await client.read_request()
            except ClientError as exc:
                logger.info(
                    "bad request", extra={"fields": {"status": exc.status, "error": str(exc)}}
                )
                await client.send_client_error(exc)
                return
            if request is None:
                return
            if not await self.run_workload(client, request, client_address, scheme):
                return

    async def _wait_for_request(self, client: ClientConnection) -> bool:
        """Wait (idle) for the first byte of a next request; False: give up."""
        if client.has_buffered():
            return True
        timeout = (
            self.config.client_header_timeout
            if client.requests_read == 0
            else self.config.keepalive_timeout
        )
        with trio.move_on_after(timeout) as idle:
            # An idle connection holds up no drain: begin_drain cancels it.
            self._idle_scopes.add(idle)
            try:
                if self.draining:
                    idle.cancel()
                await client.wait_input()
            finally:
                self._idle_scopes.discard(idle)
        return client.has_buffered() and not (self.draining and client.closed is not None)

    def begin_drain(self) -> None:
        """Stop taking new requests: idle keep-alive connections close now."""
        self.draining = True
        for scope in list(self._idle_scopes):
            scope.cancel()

    # -- one workload --------------------------------------------------------

    async def run_workload(
        self,
        client: ClientConnection,
        request: ClientRequest,
        client_address: str | None = None,
        scheme: str = "http",
    ) -> bool:
        """Serve one request: attempts, failover, relay. Returns keep-alive."""
        now = trio.current_time()
        self.expire_cooldowns(now)
        work = Workload(
            id=workload_id(request.headers),
            method=request.method.decode("ascii", "replace"),
            path=request.target.split(b"?", 1)[0].decode("ascii", "replace"),
            started=now,
        )
        document = self._body_json(request) if self._needs_body_json else None
        model = document.get("model") if isinstance(document, dict) else None
        selected = get(request.headers, b"x-failover-node")
        candidates = resolve_candidates(
            self.config.upstreams,
            model=model if isinstance(model, str) else None,
            is_cooling=lambda name: self.cooldowns.is_cooling(name, now),
            selected=selected.decode("latin-1") if selected else None,
            affinity_key=affinity_key(document) if self.config.affinity == "prefix" else None,
        )
        if self.config.max_attempts:
            candidates = candidates[: self.config.max_attempts]
        self._publish_workload(work)

        keep_alive = False
        try:
            async with trio.open_nursery() as nursery:
                if self.config.client_close != "ignore":
                    nursery.start_soon(self._watch_client, client, work, nursery.cancel_scope)
                keep_alive = await self._serve_workload(
                    client, request, work, candidates, document, client_address, scheme
                )
                nursery.cancel_scope.cancel()
        except Exception:
            # The one place that turns an unexpected failure into an answer:
            # the process keeps serving other connections.
            logger.exception("internal error", extra={"fields": {"id": work.id}})
            work.state = "failed"
            if work.committed_at is None:
                await self._send_failure(
                    client, work, 502, "internal_error", "internal proxy error"
                )
            keep_alive = False
        if work.client_left is not None and work.state not in ("completed", "failed"):
            self._client_aborted(work)
            keep_alive = False
        self._finish(work)
        return keep_alive and client.reusable

    async def _watch_client(
        self, client: ClientConnection, work: Workload, workload_scope: trio.CancelScope
    ) -> None:
        how = await client.wait_closed()
        if how is Closed.EOF and self.config.client_close == "rst-only":
            return  # a half-closed client still waits for its answer
        work.client_left = how
        workload_scope.cancel()

    async def _serve_workload(
        self,
        client: ClientConnection,
        request: ClientRequest,
        work: Workload,
        candidates: list[Upstream],
        document: Any,
        client_address: str | None,
        scheme: str,
    ) -> bool:
        if not candidates:
            work.state, work.status = "failed", 404
            message = f"no node serves model {document.get('model')!r}"
            await self._send_failure(client, work, 404, "model_not_found", message)
            return True
        last_answer: SavedResponse | None = None
        for number, node in enumerate(candidates, start=1):
            work.node, work.attempt_started, work.state = node.name, trio.current_time(), "running"
            work.attempt = number
            self._publish_workload(work)
            outgoing = self._request_for(node, request, work, document, client_address, scheme)
            stats = self.stats[node.name]
            stats.in_flight += 1
            try:
                try:
                    response = await open_response(
                        node, outgoing, connector=self.connector, config=self.config, pool=self.pool
                    )
                except UpstreamError as exc:
                    failure = exc
                else:
                    try:
                        relayed = await self._relay(client, work, node, response)
                    except BaseException:
                        await response.aclose()  # cancelled or failed: never pooled
                        raise
                    # Only a response relayed to its end, to a client still
                    # there, frees a connection for reuse; a workload whose
                    # client left (FIN or RST, whatever --client-close says)
                    # counts as abandoned and closes it.
                    if relayed and client.closed is None:
                        await response.release()
                    else:
                        await response.aclose()
                    return relayed
            finally:
                stats.in_flight -= 1
            if isinstance(failure, RetryableResponse) and failure.saved is not None:
                last_answer = failure.saved
            if not self._attempt_failed(work, node, failure, last=number == len(candidates)):
                break
        work.state = "failed"
        if last_answer is not None:
            work.status = last_answer.status
            return await self._send_saved(client, work, last_answer)
        status = failure_status(work.attempts)
        code = "upstream_timeout" if status == 504 else "upstream_unavailable"
        await self._send_failure(client, work, status, code, "every node failed")
        return True

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
            while not response.complete:
                with trio.move_on_after(idle_timeout) as idle:
                    chunk = await response.receive_chunk()
                if idle.cancelled_caught:
                    self._stream_ended(
                        work, node, Outcome.STREAM_IDLE_TIMEOUT, "stream went silent"
                    )
                    return False
                work.body_bytes += len(chunk)
                if not response.complete:
                    await client.send(h11.Data(data=chunk))
                elif chunk:  # the last bytes and the end in one write
                    await client.send(h11.Data(data=chunk), h11.EndOfMessage())
                else:
                    await client.send(h11.EndOfMessage())
        except UpstreamError as exc:
            # After commit nothing is replayed: the client sees a truncated
            # response (no terminating chunk, or a short Content-Length body).
            outcome = (
                Outcome.DEAD_PEER if exc.outcome is Outcome.DEAD_PEER else Outcome.STREAM_BROKEN
            )
            self._stream_ended(work, node, outcome, str(exc))
            return False
        except ClientGone:
            if work.client_left is None:
                work.client_left = Closed.RESET
            if self.config.client_close == "ignore":
                await self._drain_ignored(response, idle_timeout)
            return False
        self._stream_ended(work, node, Outcome.COMPLETED, "")
        return True

    async def _drain_ignored(self, response: UpstreamResponse, idle_timeout: float) -> None:
        """``--client-close ignore``: let the node finish although nobody listens."""
        while not response.complete:
            with trio.move_on_after(idle_timeout) as idle:
                try:
                    await response.receive_chunk()
                except UpstreamError:
                    return
            if idle.cancelled_caught:
                return

    # -- requests to nodes ---------------------------------------------------

    def _body_json(self, request: ClientRequest) -> Any:
        if request.body.lstrip()[:1] != b"{":
            return None
        try:
            return json.loads(request.body)
        except (ValueError, UnicodeDecodeError):
            return None

    def _request_for(
        self,
        node: Upstream,
        request: ClientRequest,
        work: Workload,
        document: Any,
        client_address: str | None,
        scheme: str,
    ) -> OutgoingRequest:
        body = request.body
        model = document.get("model") if isinstance(document, dict) else None
        if isinstance(model, str) and node.models is not None:
            node_model = node.model_name_for(model)
            if node_model != model:
                body = json.dumps({**document, "model": node_model}).encode()
        target = request.target
        if target[:1] != b"/":  # absolute-form: keep the path and query only
            target = b"/" + target.split(b"://", 1)[-1].partition(b"/")[2]
        if node.base_path:
            target = node.base_path.encode() + target
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
        return OutgoingRequest(method=request.method, target=target, headers=headers, body=body)

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
        return True

    async def _send_failure(
        self, client: ClientConnection, work: Workload, status: int, code: str, message: str
    ) -> None:
        work.status = status
        attempts = [record.to_json() for record in work.attempts]
        document: dict[str, object] = {
            "error": {
                "message": message,
                "type": "upstream_error" if status >= 500 else "invalid_request_error",
                "code": code,
                "attempts": attempts,
            },
            "attempts": attempts,
        }
        headers = [
            (b"x-request-id", work.id.encode()),
            (b"x-failover-attempts", b"%d" % len(work.attempts)),
        ]
        with contextlib.suppress(ClientGone, h11.LocalProtocolError):
            await client.send_json(status, document, headers)

    # -- bookkeeping: records, cooldowns, events, metrics, logs ----------------

    def _attempt_failed(
        self, work: Workload, node: Upstream, failure: UpstreamError, *, last: bool
    ) -> bool:
        """Record a failed attempt and execute its verdict; True: try the next node."""
        now = trio.current_time()
        retry_after = None
        status = None
        if isinstance(failure, RetryableResponse):
            status = failure.status
            value = get(failure.headers, b"retry-after")
            if status == 429 and value is not None:
                date = get(failure.headers, b"date")
                retry_after = parse_retry_after(
                    value.decode("latin-1"), date=date.decode("latin-1") if date else None
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
        work.attempts.append(record)
        self.stats[node.name].failed += 1
        self.metrics.child(self.metrics.attempts, node.name, str(failure.outcome)).inc()
        moving_on = verdict.fail_over and not last
        if moving_on:
            self.metrics.child(self.metrics.failovers, node.name, str(failure.outcome)).inc()
        logger.warning(
            "failover" if moving_on else "attempt failed",
            extra={"fields": {"id": work.id, **record.to_json()}},
        )
        if verdict.cooldown > 0:
            self._demote(node.name, verdict.cooldown, str(failure.outcome), now)
        return verdict.fail_over

    def _demote(self, node: str, duration: float, reason: str, now: float) -> None:
        entry = self.cooldowns.demote(node, now=now, duration=duration, reason=reason)
        self.metrics.child(self.metrics.cooldowns, node, reason).inc()
        self.metrics.cooling.set(len(self.cooldowns.active(now)))
        until = round(entry.remaining(now), 3)
        logger.warning(
            "cooldown", extra={"fields": {"node": node, "reason": reason, "for_s": until}}
        )
        self.events.publish(
            {"type": "node", "node": node, "state": "cooling", "reason": reason, "until_s": until}
        )

    def expire_cooldowns(self, now: float | None = None) -> None:
        """Notice cooldowns that ran out (publishing ``ready`` node events)."""
        if now is None:
            now = trio.current_time()
        ended = self.cooldowns.expire(now)
        if ended:  # asked at every workload: the common answer costs nothing
            for entry in ended:
                self._node_ready(entry.node, "expired")
            self.metrics.cooling.set(len(self.cooldowns.active(now)))

    def _node_ready(self, node: str, reason: str) -> None:
        logger.info("node ready", extra={"fields": {"node": node, "reason": reason}})
        self.events.publish(
            {"type": "node", "node": node, "state": "ready", "reason": reason, "until_s": 0}
        )

    def _committed(self, work: Workload, node: Upstream, response: UpstreamResponse) -> None:
        now = trio.current_time()
        work.committed_at = now
        work.state = "committed"
        work.status = response.status
        self.stats[node.name].served += 1
        ended = self.cooldowns.restore(node.name)
        if ended is not None:
            if ended.until > now:
                self._node_ready(node.name, "success")
            self.metrics.cooling.set(len(self.cooldowns.active(now)))
        self.metrics.child(self.metrics.commits, node.name).inc()
        timings = response.timings
        self.metrics.child(self.metrics.time_to_head, node.name).observe(
            timings.head - timings.written
        )
        self.metrics.child(self.metrics.time_to_commit, node.name).observe(now - work.started)
        self._publish_workload(work)

    def _stream_ended(self, work: Workload, node: Upstream, outcome: Outcome, detail: str) -> None:
        now = trio.current_time()
        record = AttemptRecord(node.name, outcome, now - work.attempt_started, work.status, detail)
        work.attempts.append(record)
        self.metrics.child(self.metrics.attempts, node.name, str(outcome)).inc()
        if outcome is Outcome.COMPLETED:
            work.state = "completed"
            return
        work.state = "failed"
        self.stats[node.name].failed += 1
        logger.warning("stream aborted", extra={"fields": {"id": work.id, **record.to_json()}})
        verdict = judge(outcome, response_header_timeout=self.config.response_header_timeout)
        if verdict.cooldown > 0:
            self._demote(node.name, verdict.cooldown, str(outcome), now)

    def _client_aborted(self, work: Workload) -> None:
        now = trio.current_time()
        if work.node is not None:
            work.attempts.append(
                AttemptRecord(
                    work.node,
                    Outcome.CLIENT_ABORT,
                    now - work.attempt_started,
                    detail=f"client {work.client_left.value if work.client_left else 'left'}",
                )
            )
            self.metrics.child(self.metrics.attempts, work.node, str(Outcome.CLIENT_ABORT)).inc()
        work.state = "cancelled"
        self.metrics.client_aborts.inc()

    @property
    def recent(self) -> list[dict[str, Any]]:
        """The last finished workloads, oldest first, in their ``/status`` form."""
        return [work.summary(ended) for work, ended in self._recent]

    def _publish_workload(self, work: Workload) -> None:
        if not self.events.subscriber_count:
            return  # no dashboard open: nothing to build
        event: dict[str, Any] = {
            "type": "workload",
            "id": work.id,
            "state": work.state,
            "node": work.node,
            "attempt": work.attempt,
            "method": work.method,
            "path": work.path,
        }
        if work.status is not None:
            event["status"] = work.status
        self.events.publish(event)

    def _finish(self, work: Workload) -> None:
        now = trio.current_time()
        self._recent.append((work, now))
        self.metrics.child(self.metrics.workloads, work.state).inc()
        if work.node is not None:
            self.metrics.child(self.metrics.duration, work.node).observe(now - work.started)
        if self.events.subscriber_count:
            self.events.publish({"type": "workload", **work.summary(now), "attempt": work.attempt})
        if not access_logger.isEnabledFor(logging.INFO):
            return
        log_access(
            {
                "id": work.id,
                "method": work.method,
                "path": work.path,
                "status": work.status,
                "state": work.state,
                "nodes": [f"{r.node}:{r.outcome}" for r in work.attempts],
                "commit_ms": (
                    _ms(work.committed_at - work.started) if work.committed_at is not None else None
                ),
                "duration_ms": _ms(now - work.started),
                "bytes": work.body_bytes,
            }
        )

    # -- status --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The ``GET /status`` document (SPEC 6)."""
        now = trio.current_time()
        self.expire_cooldowns(now)
        nodes = []
        for node in self.config.upstreams:
            entry = self.cooldowns.get(node.name, now)
            stats = self.stats[node.name]
            nodes.append(
                {
                    "name": node.name,
                    "url": redact_url(node.url),
                    "state": "cooling" if entry else "ready",
                    "cooldown_remaining_s": round(entry.remaining(now), 3) if entry else 0,
                    "reason": entry.reason if entry else None,
                    "in_flight": stats.in_flight,
                    "served": stats.served,
                    "failed": stats.failed,
                }
            )
        return {"version": __version__, "nodes": nodes, "workloads": self.recent}
