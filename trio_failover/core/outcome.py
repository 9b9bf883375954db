"""Pure: what an attempt's outcome means for the workload and for the node.

Two questions are answered here and nowhere else:

1. May the workload move on to the next candidate, and does the node cool
   down (``judge``, from the outcome's row in ``RULES``)?
2. Does a response head, and perhaps a small error body, count as an answer
   to relay or as a reason to fail over (``classify_head``, ``error_code``)?

The Trio code executes these verdicts; it never decides them in ``except``
blocks. Nothing here reads a clock: times come in as arguments.
"""

from __future__ import annotations

import datetime
import enum
import json
from collections.abc import Collection, Iterable
from email.utils import parsedate_to_datetime

import attrs

from .headers import Headers, get


class Outcome(enum.StrEnum):
    """How one attempt (or the streaming after commit) ended."""

    CONNECT_FAILED = "connect_failed"
    CONNECT_TIMEOUT = "connect_timeout"
    TLS_ERROR = "tls_error"
    HEADER_TIMEOUT = "header_timeout"
    # A liveness check (GET /health) found no answer while the attempt waited
    # for a head or a first body byte (docs/failover.md).
    UNRESPONSIVE = "unresponsive"
    FIRST_BODY_TIMEOUT = "first_body_timeout"
    RESET = "reset"
    CLOSED_EARLY = "closed_early"
    PROTOCOL_ERROR = "protocol_error"
    DEAD_PEER = "dead_peer"
    RETRYABLE_RESPONSE = "retryable_response"
    MODEL_NOT_FOUND = "model_not_found"  # a 404 "model not found": a stale inventory
    CLIENT_ABORT = "client_abort"
    SHUTDOWN = "shutdown"  # cut at the end of a drain (--shutdown-timeout)
    # After commit:
    COMPLETED = "completed"
    STREAM_IDLE_TIMEOUT = "stream_idle_timeout"
    STREAM_BROKEN = "stream_broken"


class Cooling(enum.Enum):
    """How long an outcome demotes its node."""

    NONE = "none"  # not at all
    STALL = "stall"  # one response-header timeout
    RETRY_AFTER = "retry_after"  # the node's own Retry-After, capped at one header timeout


@attrs.frozen
class Rule:
    """What one outcome means (one row of ``RULES``).

    Attributes:
        fails_over: the workload may move on to the next candidate.
        cools: whether, and for how long, the node is demoted.
        timed_out: a deadline ended the attempt (or the stream).
        status: the proxy's own answer when every attempt ended like this
            (504 for a deadline before commit, else 502); None where the
            proxy never answers for the node (after commit, client gone).
        rechecks: the node's inventory is checked again at once.
    """

    fails_over: bool
    cools: Cooling
    timed_out: bool
    status: int | None
    rechecks: bool = False


_FAST = Rule(fails_over=True, cools=Cooling.NONE, timed_out=False, status=502)
# A stall proves the node cannot serve right now; a dead peer is gone for a
# while (it is restarting). Both demote for one response-header duration.
_STALL = Rule(fails_over=True, cools=Cooling.STALL, timed_out=True, status=504)
# Client abort, commit and the endings after commit never fail over (nothing
# is replayed once bytes went out); a client leaving is never the node's fault.
_SETTLED = Rule(fails_over=False, cools=Cooling.NONE, timed_out=False, status=None)

RULES: dict[Outcome, Rule] = {
    Outcome.CONNECT_FAILED: _FAST,
    Outcome.CONNECT_TIMEOUT: attrs.evolve(_FAST, timed_out=True, status=504),
    Outcome.TLS_ERROR: _FAST,
    Outcome.HEADER_TIMEOUT: _STALL,
    # The node answered neither the request nor a GET /health of its own
    # (or a check found it down): a deadline's answer (504), but the check
    # already marked the node down, which demotes it until it answers again.
    Outcome.UNRESPONSIVE: attrs.evolve(_STALL, cools=Cooling.NONE),
    Outcome.FIRST_BODY_TIMEOUT: _STALL,
    Outcome.RESET: _FAST,
    Outcome.CLOSED_EARLY: _FAST,
    Outcome.PROTOCOL_ERROR: _FAST,
    Outcome.DEAD_PEER: _STALL,
    Outcome.RETRYABLE_RESPONSE: attrs.evolve(_FAST, cools=Cooling.RETRY_AFTER),
    # The node does not have the model (any more): another node may, and the
    # node's inventory is stale, so it is asked again rather than demoted.
    Outcome.MODEL_NOT_FOUND: attrs.evolve(_FAST, rechecks=True),
    Outcome.CLIENT_ABORT: _SETTLED,
    # The proxy stopped: never the node's fault, and nothing is replayed.
    Outcome.SHUTDOWN: _SETTLED,
    Outcome.COMPLETED: _SETTLED,
    # After commit a stall still demotes, but nothing is replayed.
    Outcome.STREAM_IDLE_TIMEOUT: attrs.evolve(_SETTLED, cools=Cooling.STALL, timed_out=True),
    Outcome.STREAM_BROKEN: _SETTLED,
}


@attrs.frozen
class Verdict:
    """What to do after an attempt ended: its ``RULES`` row, applied to the settings.

    Attributes:
        fail_over: try the next candidate (pre-commit failures only).
        cooldown: demote the node for this many seconds (0: no demotion).
        timed_out: a deadline ended the attempt (the row's ``timed_out``).
        recheck: ask for the node's inventory again now (the row's ``rechecks``).
    """

    fail_over: bool
    cooldown: float
    timed_out: bool
    recheck: bool = False


def judge(
    outcome: Outcome, *, response_header_timeout: float, retry_after: float | None = None
) -> Verdict:
    """Decide failover and cooldown for one attempt's outcome, from its ``RULES`` row.

    Args:
        outcome: how the attempt ended.
        response_header_timeout: the configured head deadline; also the
            length of a stall's cooldown and the cap of a ``Retry-After``.
        retry_after: seconds from a 429's ``Retry-After`` header, if any.
    """
    rule = RULES[outcome]
    cooldown = 0.0
    if rule.cools is Cooling.STALL:
        cooldown = response_header_timeout
    elif rule.cools is Cooling.RETRY_AFTER and retry_after:
        cooldown = min(retry_after, response_header_timeout)
    return Verdict(
        fail_over=rule.fails_over,
        cooldown=cooldown,
        timed_out=rule.timed_out,
        recheck=rule.rechecks,
    )


def retry_after_of(status: int, headers: Headers) -> float | None:
    """Seconds a retryable answer asks the proxy to leave its node alone, if any.

    Only a 429's ``Retry-After`` demotes the node; other
    retryable answers fail over without a cooldown.
    """
    value = get(headers, b"retry-after")
    if status != 429 or value is None:
        return None
    date = get(headers, b"date")
    return parse_retry_after(value.decode("latin-1"), date=date.decode("latin-1") if date else None)


def after_commit(outcome: Outcome) -> Outcome:
    """The outcome of a stream that broke after commit, from its error's outcome."""
    return Outcome.DEAD_PEER if outcome is Outcome.DEAD_PEER else Outcome.STREAM_BROKEN


def may_pool(*, relayed: bool, client_gone: bool) -> bool:
    """Whether a node connection may carry another request after this one.

    Only a response relayed to its end, to a client still there, frees a
    connection for reuse; a workload whose client left (FIN or RST, whatever
    ``--client-close`` says) counts as abandoned and closes it.
    """
    return relayed and not client_gone


class HeadAction(enum.Enum):
    """What to do with a response head before anything reaches the client."""

    COMMIT = "commit"  # wait for the first body byte, then relay
    RETRY = "retry"  # a retryable status: keep it as the last answer, fail over
    INSPECT = "inspect"  # a 4xx that may carry a retryable error code: read its body


def classify_head(
    status: int, *, retry_status: Iterable[int], retry_error_codes: Iterable[str]
) -> HeadAction:
    """Classify a final response status.

    A ``404`` is always inspected: its body may say "model not found"
    (``inventory.is_model_not_found``), which fails over.
    """
    if status in retry_status:
        return HeadAction.RETRY
    if status == 404:
        return HeadAction.INSPECT
    if 400 <= status < 500 and any(True for _ in retry_error_codes):
        return HeadAction.INSPECT
    return HeadAction.COMMIT


def fails_over_on(action: HeadAction, code: str | None, retry_error_codes: Iterable[str]) -> bool:
    """Whether an inspected or retryable head (and its body's error code) means "fail over"."""
    return action is HeadAction.RETRY or (code is not None and code in retry_error_codes)


def error_field(body: bytes) -> object:
    """The ``error`` member of a JSON error body (OpenAI's object, Ollama's string), else None."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        # ValueError covers bad JSON and bad UTF-8; RecursionError a node's
        # body of thousands of nested brackets, which is garbage all the same.
        return None
    return document.get("error") if isinstance(document, dict) else None


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

# The engines' own answers to a prompt longer than their context, which say
# so without OpenAI's ``"code": "context_length_exceeded"`` (their ``code``
# is the HTTP status, a number). Each row: the member of the error object,
# the text that shows it (an exact value for ``type``, a part of the text,
# compared in lower case, for ``message``), and the name it goes by.
ENGINE_ERRORS: tuple[tuple[str, str, str], ...] = (
    # llama-server: 400 {"error": {"code": 400, "type": "exceed_context_size_error",
    # "message": "request (N tokens) exceeds the available context size (M tokens), ...",
    # "n_prompt_tokens": N, "n_ctx": M}}
    ("type", "exceed_context_size_error", CONTEXT_LENGTH_EXCEEDED),
    # vLLM: 400 {"error": {"code": 400, "type": "BadRequestError", "message": "This
    # model's maximum context length is N tokens. However, ..."}} (before its
    # errors were wrapped in "error", the same members at the top level).
    ("message", "maximum context length is", CONTEXT_LENGTH_EXCEEDED),
)


def error_names(body: bytes) -> tuple[str, ...]:
    """The names a JSON error answer goes by, for ``--retry-error-codes``.

    Its ``error.code`` where that is a string, its ``error.type``, and the
    name of an engine's own answer that ``ENGINE_ERRORS`` knows (llama-server's
    and vLLM's context-length answers are ``context_length_exceeded``), in
    that order, each once. The error object is OpenAI's ``{"error": {...}}``,
    or a document whose ``"object"`` is ``"error"`` (older vLLM releases).

    Returns:
        The names; empty for anything that is no such error.
    """
    error = _error_object(body)
    if error is None:
        return ()
    names: list[str] = [
        str(error[member]) for member in ("code", "type") if isinstance(error.get(member), str)
    ]
    for member, shows, name in ENGINE_ERRORS:
        text = error.get(member)
        if not isinstance(text, str):
            continue
        if (text == shows) if member == "type" else (shows in text.lower()):
            names.append(name)
    return tuple(dict.fromkeys(names))


def _error_object(body: bytes) -> dict[str, object] | None:
    """The error object of a JSON error body (see ``error_names``), else None."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # as in ``error_field``
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict):
        return error
    if error is None and document.get("object") == "error":
        return document
    return None  # Ollama's string, or anything else that is not an object


def error_code(body: bytes, listed: Collection[str] = ()) -> str | None:
    """The error code of a JSON error body that decides and names a retry.

    Args:
        body: the (small, complete) body of a 4xx or retryable answer.
        listed: ``--retry-error-codes``.

    Returns:
        The first of its ``error_names`` that is listed; else its string
        ``error.code`` (which then only names the answer in the attempt's
        detail); else None.
    """
    names = error_names(body)
    chosen = next((name for name in names if name in listed), None)
    if chosen is not None:
        return chosen
    error = _error_object(body)
    code = None if error is None else error.get("code")
    return code if isinstance(code, str) else None


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
    """A complete, small retryable answer, kept in case it is the last one."""

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
        """Whether this attempt ran into a deadline before commit (its row's 504)."""
        return RULES[self.outcome].status == 504

    def to_json(self) -> dict[str, object]:
        """The ``{"node", "outcome", "elapsed_ms"}`` form of an error body's ``attempts``."""
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
    """504 if any attempt ran into a deadline, else 502."""
    return 504 if any(record.timed_out for record in attempts) else 502


def failure_code(status: int) -> str:
    """The ``error.code`` of the proxy's own 502/504 after every node failed."""
    return "upstream_timeout" if status == 504 else "upstream_unavailable"
