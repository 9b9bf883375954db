"""The exception tree of trio-failover.

Every class carries its context in attributes, not only in its message, so
callers (the CLI, the proxy's error responses, embedders) can act on it.
Trio and OS errors are mapped into this tree once, at the I/O boundary, in
``upstream.py``; whether an error means "try the next node" is decided in
``outcome.py``, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

from .outcome import Outcome, SavedResponse


class FailoverError(Exception):
    """Base class of every error raised by trio-failover."""


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` shown as ``***@``."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return scheme + sep + authority + slash + path


def _masked(value: object) -> object:
    # A value already masked (a Redis URL shows "user:***@") stays as it is.
    if not isinstance(value, str) or "://" not in value or ":***@" in value:
        return value
    return redact_url(value)


class ConfigError(FailoverError, ValueError):
    """A setting is invalid; names the option, where it came from and the value.

    The message shows a URL's ``user:password@`` as ``***@``, as ``check``
    lists it; ``value`` keeps what was given.
    """

    def __init__(self, option: str, value: object, expected: str, source: str = "") -> None:
        self.option = option
        self.value = value
        self.expected = expected
        self.source = source or option
        shown = _masked(value)
        super().__init__(f"{self.source}: invalid value {shown!r} for {option}: {expected}")


class ConfigErrors(ConfigError):
    """Several settings are invalid at once; ``errors`` holds each, one line apiece.

    The first one's ``option``, ``value`` and ``source`` are this error's own,
    so that code which expects a single ``ConfigError`` still reads sense.
    """

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = tuple(errors)
        first = self.errors[0]
        super().__init__(first.option, first.value, first.expected, first.source)
        self.args = ("\n".join(str(error) for error in self.errors),)


class ClientError(FailoverError):
    """The client's request is unacceptable; ``status`` is the HTTP answer to give."""

    def __init__(self, status: int, message: str, code: str) -> None:
        self.status = status
        self.code = code
        super().__init__(message)


class UpstreamError(FailoverError):
    """One attempt at one node failed; ``phase`` says where.

    Phases: ``connect``, ``write``, ``head``, ``error body``, ``first body
    byte`` (all before commit) and ``body`` (after it).
    """

    outcome: Outcome
    # Liveness checks the attempt waited on before it failed (docs/failover.md);
    # set on the instance only when there were any.
    checks: int = 0

    def __init__(self, node: str, phase: str, detail: str) -> None:
        self.node = node
        self.phase = phase
        self.detail = detail
        super().__init__(f"{node}: {phase}: {detail}")


class ConnectFailed(UpstreamError):
    """The TCP (or TLS) connection to the node could not be established."""

    outcome = Outcome.CONNECT_FAILED


class ConnectTimeout(UpstreamError):
    """The connection was not established within the connect timeout."""

    outcome = Outcome.CONNECT_TIMEOUT


class TLSError(UpstreamError):
    """The TLS handshake with the node failed (untrusted certificate, bad name...)."""

    outcome = Outcome.TLS_ERROR


class HeaderTimeout(UpstreamError):
    """The request was written but no complete response head came in time."""

    outcome = Outcome.HEADER_TIMEOUT


class Unresponsive(UpstreamError):
    """No head (or first body byte) yet, and the node's liveness check got no answer either."""

    outcome = Outcome.UNRESPONSIVE


class FirstBodyTimeout(UpstreamError):
    """The head came but the first body byte did not, within the opt-in deadline."""

    outcome = Outcome.FIRST_BODY_TIMEOUT


class UpstreamReset(UpstreamError):
    """The node reset the connection before the response was committed."""

    outcome = Outcome.RESET


class UpstreamClosedEarly(UpstreamError):
    """The node closed the connection before the response was committed."""

    outcome = Outcome.CLOSED_EARLY


class UpstreamProtocolError(UpstreamError):
    """The node sent something that is not valid HTTP/1.1."""

    outcome = Outcome.PROTOCOL_ERROR


class DeadPeer(UpstreamError):
    """The kernel declared the node dead (keepalive probes or sent data unacknowledged)."""

    outcome = Outcome.DEAD_PEER


class RetryableResponse(UpstreamError):
    """The node answered with a status or error code that the proxy fails over on."""

    outcome = Outcome.RETRYABLE_RESPONSE

    def __init__(
        self,
        node: str,
        phase: str,
        detail: str,
        status: int,
        headers: list[tuple[bytes, bytes]],
        saved: SavedResponse | None,
    ) -> None:
        self.status = status
        self.headers = headers
        # The whole answer, to relay if it is the last one; None when its
        # body was too long to hold (a cut body must never pass for whole).
        self.saved = saved
        super().__init__(node, phase, detail)


class ModelNotFound(RetryableResponse):
    """The node answered ``404`` "model not found": its inventory is stale; fail over."""

    outcome = Outcome.MODEL_NOT_FOUND


class IllegalTransition(FailoverError, RuntimeError):
    """A workload was moved to a state its transition table does not allow (a bug)."""

    def __init__(self, current: str, new: str) -> None:
        self.current = current
        self.new = new
        super().__init__(f"illegal workload transition {current} -> {new}")


class StateError(FailoverError):
    """The shared state (Redis, docs/replicas.md) failed one operation; ``operation`` names it.

    Raised by ``wire/redis.py`` only, where Trio, OS, TLS and RESP errors are
    mapped once. The callers of the shared state decide what it means (go on
    alone with the local state); a request never sees one.
    """

    def __init__(self, operation: str, detail: str) -> None:
        self.operation = operation
        self.detail = detail
        super().__init__(f"shared state: {operation}: {detail}")


class StateUnavailable(StateError):
    """Redis cannot be reached, or the connection to it was lost or is closed."""


class StateTimeout(StateError):
    """Redis did not answer within the deadline the caller passed in."""

    def __init__(self, operation: str, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(operation, f"no answer within {timeout:g}s")


class StateReplyError(StateError):
    """Redis answered with an error reply; ``code`` is its first word (``NOSCRIPT``...)."""

    def __init__(self, operation: str, message: str) -> None:
        self.code = message.partition(" ")[0]
        self.message = message
        super().__init__(operation, message)
