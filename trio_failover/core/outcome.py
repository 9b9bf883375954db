"""Pure: what an attempt's outcome means for the workload and for the node.

Two questions are answered here and nowhere else:

1. May the workload move on to the next candidate, and does the node cool
   down (``judge``)?
2. Does a response head, and perhaps a small error body, count as an answer
   to relay or as a reason to fail over (``classify_head``, ``error_code``)?

The Trio code executes these verdicts; it never decides them in ``except``
blocks. Nothing here reads a clock: times come in as arguments.
"""

from __future__ import annotations

import datetime
import enum
import json
from collections.abc import Iterable
from email.utils import parsedate_to_datetime

import attrs


class Outcome(enum.StrEnum):
    """How one attempt (or the streaming after commit) ended."""

    CONNECT_FAILED = "connect_failed"
    CONNECT_TIMEOUT = "connect_timeout"
    TLS_ERROR = "tls_error"
    HEADER_TIMEOUT = "header_timeout"
    FIRST_BODY_TIMEOUT = "first_body_timeout"
    RESET = "reset"
    CLOSED_EARLY = "closed_early"
    PROTOCOL_ERROR = "protocol_error"
    DEAD_PEER = "dead_peer"
    RETRYABLE_RESPONSE = "retryable_response"
    CLIENT_ABORT = "client_abort"
    # After commit:
    COMPLETED = "completed"
    STREAM_IDLE_TIMEOUT = "stream_idle_timeout"
    STREAM_BROKEN = "stream_broken"


@attrs.frozen
class Verdict:
    """What to do after an attempt ended.

    Attributes:
        fail_over: try the next candidate (pre-commit failures only).
        cooldown: demote the node for this many seconds (0: no demotion).
        timed_out: the attempt ran into a deadline (makes the final answer 504).
    """

    fail_over: bool
    cooldown: float
    timed_out: bool


_FAST_ERRORS = frozenset(
    {
        Outcome.CONNECT_FAILED,
        Outcome.TLS_ERROR,
        Outcome.RESET,
        Outcome.CLOSED_EARLY,
        Outcome.PROTOCOL_ERROR,
    }
)
# A stall proves the node cannot serve right now; a dead peer is gone for a
# while (it is restarting). Both demote for one response-header duration.
_STALLS = frozenset(
    {
        Outcome.HEADER_TIMEOUT,
        Outcome.FIRST_BODY_TIMEOUT,
        Outcome.DEAD_PEER,
    }
)


def judge(
    outcome: Outcome, *, response_header_timeout: float, retry_after: float | None = None
) -> Verdict:
    """Decide failover and cooldown for one attempt's outcome.

    Args:
        outcome: how the attempt ended.
        response_header_timeout: the configured head deadline; also the
            length of a stall's cooldown and the cap of a ``Retry-After``.
        retry_after: seconds from a 429's ``Retry-After`` header, if any.
    """
    if outcome in _FAST_ERRORS:
        return Verdict(fail_over=True, cooldown=0.0, timed_out=False)
    if outcome is Outcome.CONNECT_TIMEOUT:
        return Verdict(fail_over=True, cooldown=0.0, timed_out=True)
    if outcome in _STALLS:
        return Verdict(fail_over=True, cooldown=response_header_timeout, timed_out=True)
    if outcome is Outcome.RETRYABLE_RESPONSE:
        cooldown = min(retry_after, response_header_timeout) if retry_after else 0.0
        return Verdict(fail_over=True, cooldown=cooldown, timed_out=False)
    if outcome is Outcome.STREAM_IDLE_TIMEOUT:
        return Verdict(fail_over=False, cooldown=response_header_timeout, timed_out=True)
    # Client abort, cancellation, commit and the post-commit endings never
    # fail over; a client leaving is never the node's fault.
    return Verdict(fail_over=False, cooldown=0.0, timed_out=False)


class HeadAction(enum.Enum):
    """What to do with a response head before anything reaches the client."""

    COMMIT = "commit"  # wait for the first body byte, then relay
    RETRY = "retry"  # a retryable status: keep it as the last answer, fail over
    INSPECT = "inspect"  # a 4xx that may carry a retryable error code: read its body


def classify_head(
    status: int, *, retry_status: Iterable[int], retry_error_codes: Iterable[str]
) -> HeadAction:
    """Classify a final response status."""
    if status in retry_status:
        return HeadAction.RETRY
    if 400 <= status < 500 and any(True for _ in retry_error_codes):
        return HeadAction.INSPECT
    return HeadAction.COMMIT


def error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI-style JSON error body, if it has one."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        # ValueError covers bad JSON and bad UTF-8; RecursionError a node's
        # body of thousands of nested brackets, which is garbage all the same.
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        return str(error["code"])
    return None


def parse_retry_after(value: str, *, date: str | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110 section 10.2.3).

    Delta-seconds are taken as they are. An HTTP-date is measured against
    the same response's ``Date`` header, ``date``: both come from the node's
    clock, so a skew between the node's and the proxy's clocks cannot stretch
    or cancel the delay (and the proxy needs no wall clock of its own).
    Anything unparsable, or a date without ``date``, gives None.
    """
    value = value.strip()
    # ASCII only: str.isdigit() also accepts "²" (a Latin-1 byte), which
    # float() then refuses.
    if value.isascii() and value.isdigit():
        return float(value)
    if date is None:
        return None
    when, now = _http_date(value), _http_date(date)
    if when is None or now is None:
        return None
    return max(0.0, when - now)


def _http_date(value: str) -> float | None:
    """Unix seconds of an HTTP-date (any of its three forms), or None."""
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, OverflowError):
        return None
    if when.tzinfo is None:
        # The asctime form and "-0000" carry no zone; HTTP dates are always
        # GMT (RFC 9110 section 5.6.7), never the proxy host's local time.
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


@attrs.frozen
class SavedResponse:
    """A complete, small retryable answer, kept in case it is the last one (SPEC 5.7)."""

    node: str
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@attrs.frozen
class AttemptRecord:
    """One finished attempt, as reported in the 502/504 body and in events."""

    node: str
    outcome: Outcome
    elapsed: float
    status: int | None = None
    detail: str = ""

    @property
    def timed_out(self) -> bool:
        """Whether this attempt ended on a deadline."""
        return self.outcome in (
            Outcome.CONNECT_TIMEOUT,
            Outcome.HEADER_TIMEOUT,
            Outcome.FIRST_BODY_TIMEOUT,
            Outcome.DEAD_PEER,
        )

    def to_json(self) -> dict[str, object]:
        """The ``{"node", "outcome", "elapsed_ms"}`` form of SPEC 5.7."""
        item: dict[str, object] = {
            "node": self.node,
            "outcome": str(self.outcome),
            "elapsed_ms": round(self.elapsed * 1000, 1),
        }
        if self.status is not None:
            item["status"] = self.status
        if self.detail:
            item["detail"] = self.detail
        return item


def failure_status(attempts: Iterable[AttemptRecord]) -> int:
    """504 if any attempt ran into a deadline, else 502 (SPEC 5.7)."""
    return 504 if any(record.timed_out for record in attempts) else 502
