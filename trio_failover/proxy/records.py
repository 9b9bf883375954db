"""The record the proxy keeps of its work: ``Workload``.

``Workload`` is one client request across all its attempts, changed only
through its own verbs (called by the workload shell: ``workload.py``,
``attempts.py``, ``milestones.py``, ``relay.py``, ``answers.py``) and read by
``Report``, ``StatusView`` and the traces. It
lives apart from ``report.py`` so that every one of them can name it
without importing another back: the package has no import cycle
(import-linter's ``acyclic_siblings`` contract). A node's state is the
board's (``board.NodeState``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ..core.outcome import AttemptRecord
from ..core.sharing import ANONYMOUS, NORMAL
from ..core.workload import State, transition
from ..wire.client import Closed

if TYPE_CHECKING:  # imported at run time only with traces on (it imports OpenTelemetry)
    from ..telemetry.tracing import WorkloadTrace


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
    trace: WorkloadTrace | None = None  # its spans, with traces on (``Report.tracing``)
    # Behind the ``state`` property: an ``on_setattr`` hook would make attrs
    # route every attribute assignment of the class (some 25 per request)
    # through a Python-level ``__setattr__``.
    _state: State = attrs.field(default=State.QUEUED, alias="state")
    status: int | None = None
    body_bytes: int = 0
    checks: int = 0  # liveness checks its attempts waited on (docs/failover.md)
    resends: int = 0  # requests sent on a fresh connection: a pooled one refused the write
    client_left: Closed | None = None
    # Its client (docs/sharing.md): the key's name, else the client header's
    # value, else "anonymous".
    client: str = ANONYMOUS
    priority: int = NORMAL  # its priority's rank (``core.sharing.PRIORITIES``), 0 = high
    model: str | None = None  # the "model" the client asked for, if its body named one
    waited: float = 0.0  # seconds spent in the queue so far, all waits together
    queued_since: float | None = None  # when the current wait began, while waiting
    # Why a cancelled workload was: "client_abort" or "shutdown"; None otherwise.
    reason: str | None = None
    # The answer's tokens as the engine reported them (or estimated from a
    # stream's content chunks: ``usage_estimated``); None until the answer ends.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_estimated: bool = False
    # Cache affinity (on): the prompt bytes that matched a chain at the node
    # that served it (0: a miss); None: off, or no prompt, or not served.
    matched_bytes: int | None = None

    @property
    def state(self) -> State:
        """Where the workload is; every assignment goes through the transition table."""
        return self._state

    @state.setter
    def state(self, new: State) -> None:
        self._state = transition(self._state, new)

    # -- the verbs: the record's one writer ------------------------------------
    # Every field changes here, through these verbs, as a node's state does
    # through the board's: the shell (workload.py, attempts.py, milestones.py,
    # relay.py, answers.py) calls them; Report, the traces, events and
    # metrics only read the record.

    def begin_attempt(self, node: str, now: float, number: int) -> None:
        """Attempt ``number`` (from 1) at ``node`` begins at ``now``: the workload runs."""
        self.node, self.attempt_started, self.attempt = node, now, number
        self.state = State.RUNNING

    def wait_in_queue(self, now: float) -> None:
        """The workload begins to wait for a slot at ``now`` (again, after a failover)."""
        if self._state is not State.QUEUED:
            self.state = State.QUEUED
        self.node, self.queued_since = None, now

    def stop_waiting(self, now: float) -> None:
        """A wait in the queue ended at ``now``: it counts against the queue budget."""
        if self.queued_since is not None:
            self.waited += now - self.queued_since
        self.queued_since = None

    def record(self, attempt: AttemptRecord) -> None:
        """Keep an ended attempt (the final answer's status is picked from these)."""
        self.attempts.append(attempt)

    def committed(self, now: float, status: int) -> None:
        """The head of ``status`` went to the client at ``now``."""
        self.committed_at, self.status = now, status
        self.state = State.COMMITTED

    def answered(self, status: int) -> None:
        """The proxy's (or a node's saved) answer of ``status`` goes to the client."""
        self.status = status

    def finish(self, state: State, reason: str | None = None) -> None:
        """The workload ends as ``state`` (``reason``: why a cancelled one was)."""
        self.state = state
        if reason is not None:
            self.reason = reason

    def sent(self, count: int) -> None:
        """``count`` more body bytes went to the client."""
        self.body_bytes += count

    def asked(self, checks: int, resends: int = 0) -> None:
        """Liveness checks an attempt waited on, and requests it sent again (stale pool)."""
        self.checks += checks
        self.resends += resends

    def cache_matched(self, matched_bytes: int) -> None:
        """The serving node had served this many bytes of its prompt (0: a miss)."""
        self.matched_bytes = matched_bytes

    def client_left_by(self, how: Closed) -> None:
        """The client closed its connection (a FIN or a reset)."""
        self.client_left = how

    def name(self, model: str | None) -> None:
        """The model the client asked for, as the summaries show it."""
        self.model = model

    def note_usage(self, prompt: int, completion: int, *, estimated: bool) -> None:
        """The answer's tokens, as its engine told them (or estimated), before it ends."""
        self.prompt_tokens, self.completion_tokens = prompt, completion
        self.usage_estimated = estimated

    def traced(self, trace: WorkloadTrace | None) -> None:
        """Its spans (traces on), kept for the milestones to tell."""
        self.trace = trace

    # -- reads -------------------------------------------------------------------

    def queued_for(self, now: float) -> float:
        """Seconds in the queue by ``now``, the current wait included."""
        current = now - self.queued_since if self.queued_since is not None else 0.0
        return self.waited + current

    def summary(self, now: float) -> dict[str, Any]:
        """The JSON form used by events, ``/status`` and the dashboard."""
        summary = {
            "id": self.id,
            "method": self.method,
            "path": self.path,
            "client": self.client,
            "model": self.model,
            "state": str(self.state),
            "status": self.status,
            "node": self.node,
            "attempts": [record.to_json() for record in self.attempts],
            "ttfb_ms": (
                ms(self.committed_at - self.started) if self.committed_at is not None else None
            ),
            "duration_ms": ms(now - self.started),
            "queued_ms": ms(self.queued_for(now)),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "usage_estimated": self.usage_estimated,
        }
        if self.reason is not None:
            summary["reason"] = self.reason
        return summary


def ms(seconds: float) -> float:
    """Seconds as milliseconds to 0.1 ms: every duration of the JSON documents and logs."""
    return round(seconds * 1000, 1)
