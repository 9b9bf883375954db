"""Pure: the states of a workload and the moves between them, as data.

Two rules, as in h11's ``_state.py``:

1. A workload's state changes only through ``transition``, which looks the
   move up in ``TRANSITIONS`` and raises ``IllegalTransition`` for any other.
2. ``COMPLETED``, ``FAILED`` and ``CANCELLED`` are final: nothing leaves them.

``QUEUED`` is where a workload starts and where it waits for a node to take
it; a failed-over workload that must wait for room on its next node goes
back from ``RUNNING`` to ``QUEUED``. ``RUNNING`` to ``RUNNING`` is the next
attempt of a failover that needs no wait. ``COMMITTED``: the first bytes of
a node's answer went to the client, so nothing is replayed any more.
"""

from __future__ import annotations

import enum

from .errors import IllegalTransition


class State(enum.StrEnum):
    """Where a workload is in its life (the ``state`` of events, ``/status`` and logs)."""

    QUEUED = "queued"
    RUNNING = "running"
    COMMITTED = "committed"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = frozenset({State.COMPLETED, State.FAILED, State.CANCELLED})

# state -> the states it may move to.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.RUNNING, State.FAILED, State.CANCELLED}),
    State.RUNNING: frozenset(
        {State.RUNNING, State.QUEUED, State.COMMITTED, State.FAILED, State.CANCELLED}
    ),
    State.COMMITTED: frozenset({State.COMPLETED, State.FAILED, State.CANCELLED}),
    State.COMPLETED: frozenset(),
    State.FAILED: frozenset(),
    State.CANCELLED: frozenset(),
}


def transition(current: State, new: State) -> State:
    """The state after moving from ``current`` to ``new``.

    Raises:
        IllegalTransition: the table has no such move.
    """
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(current, new)
    return new
