"""Pure: when a silent node is asked whether it is alive, and what its answer means.

Silence is a question (docs/failover.md, "Liveness checks"): every
``--liveness-interval`` of a node's silence towards a wait, the node is
asked ``GET /health``; one that does not answer is marked ``down``.

This module decides, from data and ``now``:

- how often a wait asks (``question_period``) and when its next question
  is due (``next_question``);
- how long a check and the reuse of a passed check last
  (``check_timeout``, ``reuses_pass``), and whether it passed (``passes``);
- whether a stream is proof of life (``moving``);
- how soon a node marked down by a check is asked again while discovery
  is off (``revive_delay``);
- what ``/status`` shows of a node's last check (``CheckRecord``).

The Trio code (``proxy/nodes/silence.py`` times the waits, ``proxy/nodes/liveness.py``
runs the checks) executes these decisions.
"""

from __future__ import annotations

import math

import attrs

LIVENESS_PATH = "/health"
# A check's head must come within min(this, response-header-timeout).
MAX_CHECK_TIMEOUT = 10.0
# A check that passed this recently answers for the node without asking again.
PASS_REUSE = 1.0
# The ``kind`` of a liveness check in events and ``/status``' ``last_check``.
KIND = "liveness"
# The reason of a node marked down by a failed liveness check.
DOWN_REASON = "unresponsive"
# How recent a body byte proves a stream alive while ``--liveness-interval`` is 0.
DEFAULT_PROOF_WINDOW = 10.0
# The longest pause between re-checks of a node that a failed check marked down
# (while discovery, which re-checks down nodes itself, is off).
MAX_REVIVE_DELAY = 30.0


def question_period(interval: float, response_header_timeout: float, *, watched: bool) -> float:
    """Seconds of silence between two questions of one wait; ``inf``: it never asks.

    ``interval``: ``--liveness-interval`` (``0``: only at the deadlines).
    ``watched``: a wait the node may legitimately make long, and whose
    deadline is therefore a question rather than a verdict: an unstreamed
    request's head (the node sends it with the whole answer), or the first
    body byte with first-body-timeout ``0`` (a long prefill). Such a wait
    also asks at each response-header timeout of silence.
    """
    period = interval if interval > 0 else math.inf
    if watched:
        period = min(period, response_header_timeout)
    return period


def next_question(since: float, last: float, period: float) -> float:
    """When the silence that began at ``since`` is next asked about, after the question at ``last``.

    Questions fall at whole periods of silence (``since + k * period``, ``k``
    from 1), so a check that took its time does not push the next one back;
    ``last``: the moment of the last question asked (``-inf``: none), which
    is never asked again.
    """
    if period == math.inf:
        return math.inf
    if last < since + period:
        return since + period
    # The tolerance keeps a question computed as since + k * period from
    # being seen as a hair before itself.
    done = math.floor((last - since) / period + 1e-9)
    return since + (done + 1) * period


def check_timeout(response_header_timeout: float) -> float:
    """Seconds a check's response head may take, from its connection made."""
    return min(MAX_CHECK_TIMEOUT, response_header_timeout)


def proof_window(interval: float) -> float:
    """How recent a relayed body byte must be to prove its node alive."""
    return interval if interval > 0 else DEFAULT_PROOF_WINDOW


def moving(silent_since: float | None, now: float, window: float) -> bool:
    """Whether a stream relayed a byte within ``window`` (``silent_since`` None: one now)."""
    return silent_since is None or now - silent_since < window


def reuses_pass(passed_at: float, now: float) -> bool:
    """Whether a check that passed at ``passed_at`` still answers for the node at ``now``."""
    return now - passed_at < PASS_REUSE


def passes(status: int | None) -> bool:
    """Whether a check passed: any status does (a ``503`` "loading" proves the process answers).

    ``None``: no head came (refused, reset, closed, not HTTP, or too late).
    """
    return status is not None


def revive_delay(failed_checks: int) -> float:
    """The pause before re-checking a node that ``failed_checks`` checks in a row found silent.

    1, 2, 4, 8 ... seconds, at most ``MAX_REVIVE_DELAY``: a node that wakes is
    back within seconds, a dead one costs a connection now and then.
    """
    return float(min(MAX_REVIVE_DELAY, 2 ** max(0, failed_checks - 1)))


@attrs.frozen
class CheckRecord:
    """One finished check of a node, as ``/status`` shows it (``last_check``).

    Attributes:
        kind: ``"liveness"``, or ``"health"`` for discovery's checks.
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
