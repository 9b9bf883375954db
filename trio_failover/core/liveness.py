"""Pure: the liveness checks of a node an attempt waits on (SPEC 2, 5.5).

An attempt that waits longer than one response-header timeout for a head
it may legitimately wait long for (an unstreamed answer comes whole), or
for the first body byte after a head (first-body-timeout ``0``), does not
guess whether its node is busy or frozen: it asks, with one ``GET /health``
on a connection of its own. This module decides, from data and ``now``:

- how long each wait, each check and the reuse of a passed check last
  (``window_end``, ``check_timeout``, ``reuses_pass``);
- what to do when a window ends and when a check answers (``at_window_end``,
  ``after_check``: check, wait on, or give up with which outcome);
- what ``/status`` shows of a node's last check (``CheckRecord``).

The Trio code (``wire/upstream.py``, ``wire/first_bytes.py`` for the waits,
``proxy/liveness.py`` for the checks) executes these decisions.
"""

from __future__ import annotations

import enum

import attrs

from .outcome import Outcome

LIVENESS_PATH = "/health"
# A check's head must come within min(this, response-header-timeout).
MAX_CHECK_TIMEOUT = 10.0
# A check that passed this recently answers for the node without asking again.
PASS_REUSE = 1.0
# The ``kind`` of a liveness check in events and ``/status``' ``last_check``.
KIND = "liveness"


class Step(enum.Enum):
    """What an attempt waiting on a node does next."""

    CHECK = "check"  # ask the node (GET /health)
    WAIT = "wait"  # wait one more window for the node's answer
    GIVE_UP = "give_up"  # end the attempt with ``Decision.outcome``


@attrs.frozen
class Decision:
    """A ``Step``, and the outcome of the attempt for ``GIVE_UP`` (else None)."""

    step: Step
    outcome: Outcome | None = None


_CHECK = Decision(Step.CHECK)
_WAIT = Decision(Step.WAIT)
_TIMED_OUT = Decision(Step.GIVE_UP, Outcome.HEADER_TIMEOUT)
_UNRESPONSIVE = Decision(Step.GIVE_UP, Outcome.UNRESPONSIVE)


def check_timeout(response_header_timeout: float) -> float:
    """Seconds a check's response head may take, from its connection made."""
    return min(MAX_CHECK_TIMEOUT, response_header_timeout)


def window_end(now: float, response_header_timeout: float, final_deadline: float) -> float:
    """When the window of waiting that begins at ``now`` ends: one header timeout, capped.

    ``final_deadline``: the attempt's last moment (``written`` plus the
    unstreamed timeout for a head; ``inf`` for a first body byte, which
    has no deadline with first-body-timeout ``0``).
    """
    return min(now + response_header_timeout, final_deadline)


def at_window_end(now: float, final_deadline: float) -> Decision:
    """A window ended without the answer: check the node, or give up at the final deadline."""
    return _TIMED_OUT if now >= final_deadline else _CHECK


def after_check(passed: bool, now: float, final_deadline: float) -> Decision:
    """A check answered: a failed one ends the attempt, a passed one waits on.

    A passed check never shortens the wait below what the attempt had
    without checks: the node keeps the attempt up to ``final_deadline``.
    """
    if not passed:
        return _UNRESPONSIVE
    return _TIMED_OUT if now >= final_deadline else _WAIT


def reuses_pass(passed_at: float, now: float) -> bool:
    """Whether a check that passed at ``passed_at`` still answers for the node at ``now``."""
    return now - passed_at < PASS_REUSE


def passes(status: int | None) -> bool:
    """Whether a check passed: any status does (a ``503`` "loading" proves the process answers).

    ``None``: no head came (refused, reset, closed, not HTTP, or too late).
    """
    return status is not None


@attrs.frozen
class CheckRecord:
    """One finished check of a node, as ``/status`` shows it (``last_check``).

    Attributes:
        kind: ``"liveness"`` (SPEC 5.5), or ``"health"`` for discovery's checks.
        ok: whether the check passed.
        status: the node's answer, if one came.
        error: why it failed (or what was odd about it), else None.
        at: Trio time the check ended.
    """

    kind: str
    ok: bool
    status: int | None
    error: str | None
    at: float

    def to_json(self, now: float) -> dict[str, object]:
        """The ``last_check`` form: ``{"kind", "ok", "status", "error", "age_s"}``."""
        return {
            "kind": self.kind,
            "ok": self.ok,
            "status": self.status,
            "error": self.error,
            "age_s": round(max(0.0, now - self.at), 3),
        }
