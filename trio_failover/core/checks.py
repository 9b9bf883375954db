"""Pure: the questions of one discovery check and what their answers mean (docs/discovery.md).

A check asks, on a fresh connection each, ``GET HEALTH_PATH`` every time
(``judge_health`` reads it: a verdict, or the news that the node is ready
or has no such route), then, unless that settled it and only while this
proxy has no attempt in flight at the node, ``GET inventory.CHECK_PATH``
(``inventory.judge_check``; ``inventory_waits`` when it must wait) and
``GET TAGS_PATH`` (``tags_answer``). Why in that order and what each answer
means: docs/discovery.md ("The check").

``next_check_at`` says when the next check begins: one interval after the
last began for a node that is not down, and for a down one sooner, after 1,
2, 4, 8 s ... up to the interval (``down_recheck_delay``), so a restarted
engine is used again within seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .inventory import (
    DOWN_REASON,
    READY_REASON_CHECK,
    CheckFailure,
    CheckVerdict,
    Health,
    tags_entries,
)

HEALTH_PATH = "/health"
TAGS_PATH = "/api/tags"
FIRST_CHECK_WINDOW = 1.0  # every node's first check begins within it
CHECK_JITTER = 0.1  # a later check comes up to this fraction of an interval early
FIRST_DOWN_RECHECK = 1.0  # seconds from a failed check to the next one, doubled each time
_MAX_DOUBLINGS = 62  # 2**62 s is past any interval; keeps the float finite


# -- question 1: /health -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthAnswer:
    """What ``GET /health`` said.

    Attributes:
        final: the check's verdict when it ends here (down, or a timeout
            that does not count); None when it goes on to question 2.
        has_route: the node answered ``2xx``: it is ready, and question 2
            only reads the inventory. False: no such route, question 2 gives
            the health too.
    """

    final: CheckVerdict | None
    has_route: bool


def judge_health(
    *,
    failure: CheckFailure | None = None,
    status: int | None = None,
    streaming: bool = False,
    detail: str = "",
) -> HealthAnswer:
    """Read the answer to question 1 (``GET /health``).

    Args:
        failure: set when the question got no answer (or one that is not HTTP).
        status: the answer's status (when ``failure`` is None).
        streaming: an attempt of this proxy at the node relayed bytes while
            the question was out: a timeout then is no sign of death.
        detail: the shell's words for the failure, for ``last_error``.

    Returns:
        Final and down on a connect failure, on a timeout while nothing
        streams, and on a ``5xx`` (llama-server's ``503`` while it loads);
        final and unchanged on a timeout while streaming. Not final, with a
        route, on a ``2xx``; not final, without one, on any other status
        (``404`` from llama-cpp-python and Ollama) or an answer that is not
        HTTP: the node answered, so question 2 decides.

    Raises:
        ValueError: neither ``failure`` nor ``status`` was given.
    """
    suffix = f" ({detail})" if detail else ""
    if failure is CheckFailure.TIMED_OUT:
        if streaming:
            verdict = CheckVerdict(
                Health.UNCHANGED, None, False, None, None, "timeout_while_streaming"
            )
            return HealthAnswer(verdict, False)
        return HealthAnswer(
            _down(f"health check: {HEALTH_PATH} timed out{suffix}", "timed_out"), False
        )
    if failure is CheckFailure.CONNECT_FAILED:
        return HealthAnswer(_down(f"health check cannot connect{suffix}", "connect_failed"), False)
    if failure is CheckFailure.NOT_HTTP:
        return HealthAnswer(None, False)
    if status is None:
        raise ValueError("judge_health needs a failure or a status")
    if status >= 500:
        error = f"health check: {HEALTH_PATH} answered {status}{suffix}"
        return HealthAnswer(_down(error, "server_error"), False)
    return HealthAnswer(None, 200 <= status < 300)


def _down(error: str, result: str) -> CheckVerdict:
    # The inventory stays: a node's models do not change by going away.
    return CheckVerdict(Health.DOWN, DOWN_REASON, False, None, error, result)


# -- question 2 deferred ----------------------------------------------------------


def inventory_waits(*, has_route: bool) -> CheckVerdict:
    """The verdict when ``/v1/models`` may not be asked now (an attempt is in flight).

    The inventory stays as it is until a later check; the health is ready
    when ``/health`` said so, else unchanged (the node has no health route,
    and its attempt in flight will tell soon enough).
    """
    if has_route:
        return CheckVerdict(
            Health.READY, READY_REASON_CHECK, False, None, None, "ok_inventory_waits"
        )
    return CheckVerdict(Health.UNCHANGED, None, False, None, None, "inventory_waits")


# -- question 3: /api/tags -----------------------------------------------------------


def tags_answer(status: int, body: bytes) -> list[dict[str, object]] | None:
    """The entries of a ``GET /api/tags`` answer; None when it is not one.

    A ``2xx`` whose body is ``{"models": [...]}`` (``null``: none) gives its
    entries as the node sent them (objects only); anything else (llama-cpp-
    python's or vLLM's ``404``, HTML, a body too large) gives None: the node
    does not answer this route.
    """
    return tags_entries(body) if 200 <= status < 300 else None


# -- the schedule -----------------------------------------------------------------------


def first_check_delays(count: int, *, window: float = FIRST_CHECK_WINDOW) -> list[float]:
    """Seconds from start to each node's first check, in ranking order.

    Spread evenly over ``[0, window)``: node ``i`` of ``count`` at
    ``window * i / count``, so no two begin together and all within the window.
    """
    return [window * index / count for index in range(count)]


def down_recheck_delay(down_checks: int, interval: float) -> float:
    """Seconds from the end of a check that left the node down to the next one.

    Args:
        down_checks: how many checks in a row have left the node down (>= 1).
        interval: ``--discovery-interval``, the most it waits.

    Returns:
        1 s after the first, then 2, 4, 8 s ..., never more than ``interval``.
    """
    doublings = min(max(down_checks, 1) - 1, _MAX_DOUBLINGS)
    return min(FIRST_DOWN_RECHECK * 2.0**doublings, interval)


def next_check_at(
    *,
    started: float,
    finished: float,
    interval: float,
    jitter: float = 0.0,
    down_checks: int = 0,
) -> float:
    """When a node's next check begins (an absolute time of the shell's clock).

    Args:
        started: when the previous check began.
        finished: when it ended (answers, failure or timeout).
        interval: ``--discovery-interval``.
        jitter: a random number in ``[0, 1]`` (clamped): the next check of a
            node that is not down comes up to ``CHECK_JITTER`` of an interval
            early, never late, so proxies sharing nodes drift apart.
        down_checks: how many checks in a row have left the node down (0:
            it is not down).

    Returns:
        For a down node, ``down_recheck_delay`` after ``finished``. Else one
        interval (less jitter) after ``started``, but never before
        ``finished``: one check per node at a time.
    """
    if down_checks > 0:
        return finished + down_recheck_delay(down_checks, interval)
    jitter = min(max(jitter, 0.0), 1.0)
    return max(started + interval * (1.0 - CHECK_JITTER * jitter), finished)
