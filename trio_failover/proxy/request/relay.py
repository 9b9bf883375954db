"""After commit: the relay of one committed response to its client.

``Relay.commit_and_relay`` sends the head and the first bytes, then streams
the rest chunk by chunk, unbuffered. A ``SilenceTimer`` (``silence.py``)
times ``--stream-idle-timeout``, watched by the proxy's one ``SilenceWatch``
task. After commit nothing is replayed: a
failure cuts the client's response short (docs/failover.md).
"""

from __future__ import annotations

import math
from collections.abc import Coroutine
from typing import Any

import h11
import trio

from ...core.config import Config, LiveConfig, Upstream, live_config
from ...core.errors import UpstreamError
from ...core.headers import client_response_headers
from ...core.liveness import question_period
from ...core.outcome import Outcome, after_commit, may_pool
from ...core.usage import UsageReader, body_kind
from ...wire.client import ClientConnection, ClientGone, Closed
from ...wire.upstream import UpstreamResponse
from ..nodes.board import NodeBoard
from ..nodes.silence import SilenceTimer, SilenceWatch
from ..records import Workload
from ..report import Report
from .milestones import Milestones


class Relay:
    """Relays committed responses; one per proxy, shared by its workloads."""

    def __init__(
        self,
        config: Config | LiveConfig,
        board: NodeBoard,
        report: Report,
        milestones: Milestones,
        silence: SilenceWatch,
    ) -> None:
        self._settings = live_config(config)
        self.board = board
        self.report = report
        self.silence = silence
        self._milestones = milestones

    async def commit_and_relay(
        self,
        client: ClientConnection,
        work: Workload,
        node: Upstream,
        response: UpstreamResponse,
        request_bytes: int = 0,
    ) -> bool:
        """Commit ``response``, relay it; True: relayed to its end.

        ``request_bytes``: the size of the request's body, a stream's
        prompt tokens when its engine tells none (``core/usage.py``).
        """
        reader = UsageReader(body_kind(response.content_type))
        try:
            relayed = await self._relay(client, work, node, response, reader, request_bytes)
        except BaseException:
            if work.prompt_tokens is None:  # cut by the client's leaving: what came is counted
                _note_usage(work, reader, request_bytes)
            await response.aclose()  # cancelled or failed: never pooled
            raise
        if may_pool(relayed=relayed, client_gone=client.closed is not None):
            await response.release()
        else:
            await response.aclose()
        return relayed

    async def _relay(
        self,
        client: ClientConnection,
        work: Workload,
        node: Upstream,
        response: UpstreamResponse,
        reader: UsageReader,
        request_bytes: int,
    ) -> bool:
        """Commit the response and stream the rest, chunk by chunk, unbuffered.

        The answer's tokens are noted on the workload before its stream ends.
        """
        self._milestones.committed(work, node, response)
        if work.trace is not None and response.progressed:  # else a later chunk's
            work.trace.first_token(response.timings.first_body)
        headers = client_response_headers(
            response.headers,
            response.status,
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
            work.sent(len(response.first_chunk))
            reader.feed(response.first_chunk)
        if response.complete:
            commit.append(h11.EndOfMessage())
        idle_timeout = self.config.stream_idle_timeout or math.inf
        try:
            await client.send(*commit)
            # A response that came whole went out with the commit: no relay
            # loop, no timer and its cancel scope to enter and leave.
            if not response.complete:
                timer = self._timer(node, response, idle_timeout)
                relayed = await self._stream_rest(client, work, response, timer, reader)
                if not relayed:
                    _note_usage(work, reader, request_bytes)
                    if timer.ended_by is not None:  # the node answered no liveness check
                        outcome, detail = Outcome.UNRESPONSIVE, timer.ended_by
                    else:
                        outcome, detail = Outcome.STREAM_IDLE_TIMEOUT, "stream went silent"
                    self._milestones.stream_ended(work, node, outcome, detail)
                    return False
        except UpstreamError as exc:
            # After commit nothing is replayed: the client sees a truncated
            # response (no terminating chunk, or a short Content-Length body).
            _note_usage(work, reader, request_bytes)
            self._milestones.stream_ended(work, node, after_commit(exc.outcome), str(exc))
            return False
        except ClientGone:
            if work.client_left is None:
                work.client_left_by(Closed.RESET)
            if self.config.client_close == "ignore":
                await _drain_ignored(response, idle_timeout, reader)
            _note_usage(work, reader, request_bytes)
            return False
        _note_usage(work, reader, request_bytes)
        self._milestones.stream_ended(work, node, Outcome.COMPLETED, "")
        return True

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def _timer(
        self, node: Upstream, response: UpstreamResponse, idle_timeout: float
    ) -> SilenceTimer:
        """The timer of a committed stream's silences: its idle timeout and its questions."""
        period = question_period(
            self.config.liveness_interval, self.config.response_header_timeout, watched=False
        )
        return SilenceTimer(idle_timeout, armed=response.progressed, node=node.name, period=period)

    def _stream_rest(
        self,
        client: ClientConnection,
        work: Workload,
        response: UpstreamResponse,
        timer: SilenceTimer,
        reader: UsageReader,
    ) -> Coroutine[Any, Any, bool]:
        """Relay the body after the commit; False: the node went silent too long.

        The silence is timed by ``timer``, registered with the proxy's
        ``SilenceWatch`` (one of the proxy's own tasks), which also knows
        from it that the node's stream moves: no deadline is moved per chunk. It
        bounds only the waits for the node, not the writes to the client,
        whose pace is not the node's silence. In an event stream only a chunk
        that begins a line other than a comment or a blank one ends a silence,
        and before the first such line the timer is not armed: the
        wait is still the first-body wait, unbounded (a long prefill with
        pings is never cut, an engine that only pings after its first token
        is).

        A plain function that returns the relay's coroutine: one suspended
        coroutine frame less per open stream than an ``async def`` around it.
        """
        return _relay_chunks(client, work, response, timer, self.silence, reader)


async def _relay_chunks(
    client: ClientConnection,
    work: Workload,
    response: UpstreamResponse,
    timer: SilenceTimer,
    watch: SilenceWatch | None,
    reader: UsageReader,
) -> bool:
    """The relay loop: read from the node, write to the client, note the silence.

    Registered with ``watch`` for as long as it runs, when one is given.
    Returns False when the timer fired.
    """
    if watch is not None:
        watch.register(timer)
    scanner = response.scanner
    try:
        with timer.scope:
            while not response.complete:
                timer.waiting_since = waited = trio.current_time()
                chunk = await response.receive_chunk()
                if timer.scope.cancel_called:
                    return False  # the timer fired as the chunk came: the deadline passed
                timer.waiting_since = None
                work.sent(len(chunk))
                reader.feed(chunk)
                if scanner is None or scanner.first_event_line(chunk) is not None:
                    if not timer.armed and work.trace is not None:  # the first event line
                        work.trace.first_token(trio.current_time())
                    timer.silence, timer.armed = 0.0, True
                else:  # a comment or a blank line: the node's silence runs on
                    timer.silence += trio.current_time() - waited
                    if timer.armed and timer.silence >= timer.timeout:
                        timer.scope.cancel()  # it came at the deadline, too late
                        return False
                if not response.complete:
                    await client.send_data(chunk)
                elif chunk:  # the last bytes and the end in one write
                    await client.send(h11.Data(data=chunk), h11.EndOfMessage())
                else:
                    await client.send(h11.EndOfMessage())
    finally:
        if watch is not None:
            watch.unregister(timer)
    return not timer.fired


def _note_usage(work: Workload, reader: UsageReader, request_bytes: int) -> None:
    """Note the answer's tokens on the workload, if its engine told them or it streamed."""
    usage = reader.usage(request_bytes)
    if usage is not None:
        work.note_usage(usage.prompt_tokens, usage.completion_tokens, estimated=usage.estimated)


async def _drain_ignored(
    response: UpstreamResponse, idle_timeout: float, reader: UsageReader
) -> None:
    """``--client-close ignore``: let the node finish although nobody listens.

    Its tokens are still the client's: the reader follows the rest.
    """
    while not response.complete:
        with trio.move_on_after(idle_timeout) as idle:
            try:
                reader.feed(await response.receive_chunk())
            except UpstreamError:
                return
        if idle.cancelled_caught:
            return
