"""The record the proxy keeps of its work: ``Workload``.

``Workload`` is one client request across all its attempts, written by the
workload shell (``workload.py``, ``attempts.py``, ``milestones.py``,
``relay.py``) and read by ``Report``, ``StatusView`` and the traces. It
lives apart from ``report.py`` so that every one of them can name it
without importing another back: the package has no import cycle
(import-linter's ``acyclic_siblings`` contract). A node's state is the
board's (``board.NodeState``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ..core.outcome import AttemptRecord
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
    resends: int = 0  # requests sent again because a pooled connection was stale
    client_left: Closed | None = None
    client: str | None = None  # the name of the client's key; None: no keys configured
    model: str | None = None  # the "model" the client asked for, if its body named one
    waited: float = 0.0  # seconds spent in the queue so far, all waits together
    queued_since: float | None = None  # when the current wait began, while waiting
    # Why a cancelled workload was: "client_abort" or "shutdown"; None otherwise.
    reason: str | None = None

    @property
    def state(self) -> State:
        """Where the workload is; every assignment goes through the transition table."""
        return self._state

    @state.setter
    def state(self, new: State) -> None:
        self._state = transition(self._state, new)

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
        }
        if self.reason is not None:
            summary["reason"] = self.reason
        return summary


def ms(seconds: float) -> float:
    """Seconds as milliseconds to 0.1 ms: every duration of the JSON documents and logs."""
    return round(seconds * 1000, 1)
