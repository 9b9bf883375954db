"""Logging set-up: text or JSON lines on stderr, with credentials scrubbed.

Log calls pass structured fields as ``extra={"fields": {...}}``; the text
format prints them as ``key=value``, the JSON format as object members:

    2026-11-29T20:00:00.123Z INFO request id=abc method=POST status=200 ...
    {"time": "2026-11-29T20:00:00.123Z", "level": "info", "logger":
     "trio_failover.access", "message": "request", "id": "abc", ...}

The proxy never logs request or response headers. As a second line of
defence both formats scrub what looks like a credential (``Bearer ...``,
``Basic ...``, ``user:password@`` in URLs) and any value registered as a
secret (the per-node header values from the configuration) from every line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

import trio

logger = logging.getLogger("trio_failover")
# An embedder that never configures logging should not get bare lines from
# Python's last-resort handler on stderr.
logger.addHandler(logging.NullHandler())
access_logger = logging.getLogger("trio_failover.access")

REDACTED = "***"


def log_access(fields: dict[str, Any]) -> None:
    """The access line of one request: ``request`` at info on ``trio_failover.access``.

    The same record ``access_logger.info("request", extra={"fields": ...})``
    would make, handed to the logger's handlers directly: a line per request
    skips the search for the calling frame (the record names this module).
    """
    if access_logger.isEnabledFor(logging.INFO):
        record = logging.LogRecord(
            access_logger.name, logging.INFO, __file__, 0, "request", None, None, "log_access"
        )
        record.fields = fields
        access_logger.handle(record)


# Authorization schemes whose parameter is the secret itself (RFC 9110 11.4).
_SCHEME_RE = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+")
# The userinfo part of a URL (RFC 3986 3.2.1): scheme://user:password@host.
_USERINFO_RE = re.compile(r"(://)[^/@\s\"']+@")
# Shorter values are too likely to occur by chance ("1", "yes") to be scrubbed.
_MIN_SECRET_LENGTH = 6
_secrets: set[str] = set()


def add_secrets(values: Iterable[str]) -> None:
    """Scrub these exact values (e.g. per-node API keys) from every log line."""
    _secrets.update(value for value in values if len(value) >= _MIN_SECRET_LENGTH)


def redact(text: str) -> str:
    """``text`` with credentials replaced by ``***``."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    # Every line passes here (one per request at info): the substring tests
    # spare the common line, which holds neither pattern, two regex scans.
    lowered = text.casefold()
    if "bearer" in lowered or "basic" in lowered:
        text = _SCHEME_RE.sub(rf"\1\2{REDACTED}", text)
    if "@" in text:
        text = _USERINFO_RE.sub(rf"\1{REDACTED}@", text)
    return text


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _redact_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(item) for item in value]
    return value


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


_last_second: list[tuple[int, str]] = [(-1, "")]


def _stamp(record: logging.LogRecord) -> str:
    # The logging module's own wall-clock stamp, formatted once per second.
    second = int(record.created)
    cached, text = _last_second[0]
    if second != cached:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _last_second[0] = (second, text)
    return f"{text}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """``2026-11-29T20:00:00.123Z INFO message key=value ...``"""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_stamp(record), record.levelname, record.getMessage()]
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            # One line a request, eleven fields: the exact types of most of
            # them (plain strings, ints, floats, None) are written here, the
            # rest by ``_text``, with the same result (tests/test_logs.py).
            for key, value in fields.items():
                kind = type(value)
                if kind is str and value and " " not in value:
                    parts.append(f"{key}={value}")
                elif kind is int or kind is float:
                    parts.append(f"{key}={value!r}")
                elif value is None:
                    parts.append(f"{key}=null")
                else:
                    parts.append(f"{key}={_text(value)}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


# Printable ASCII but space, '"' and '\\': json.dumps would write it as is.
_PLAIN_RE = re.compile(r"[!#-\[\]-~]*")


def _text(value: object) -> str:
    # One access line a request: plain strings, numbers and lists of plain
    # strings (the attempts) skip json.dumps.
    if type(value) is list:
        if not value:
            return "[]"
        try:
            joined = ",".join(value)  # a TypeError, not a scan, finds a non-string
        except TypeError:
            joined = None
        # "," is plain too: the joined items are plain if and only if each is.
        if joined is not None and _PLAIN_RE.fullmatch(joined):
            return '["' + '","'.join(value) + '"]'
    elif isinstance(value, str):
        return json.dumps(value) if (" " in value or not value) else value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)

    text = json.dumps(value, separators=(",", ":"))
    return json.dumps(text) if " " in text else text


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the fields.

    A field named like one of the four fixed keys would overwrite it; the
    proxy's fields never do.
    """

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": _stamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        document.update(_fields(record))
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        # Scrub before serialising: JSON escaping could hide a secret that
        # contains a quote or a backslash from a scrub of the finished line.
        document = _redact_value(json.loads(json.dumps(document, default=str)))
        return json.dumps(document, ensure_ascii=False)


class BatchedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that keeps formatted lines until ``flush()``.

    One write (a system call) per log line is a large part of a small
    request's cost; the ``serve`` command flushes this handler once per pass
    of Trio's event loop instead (``FlushLogs``), so a line reaches the
    stream at the latest when the loop next waits for I/O: microseconds to
    milliseconds after the request, not seconds. The order of lines is kept.
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream)
        self.pending: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.pending.append(self.format(record) + self.terminator)
        except Exception:  # the logging module's contract: report, never raise
            self.handleError(record)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            lines, self.pending = self.pending, []
            if lines:
                self.stream.write("".join(lines))
            super().flush()


class FlushLogs(trio.abc.Instrument):
    """A Trio instrument that flushes a ``BatchedStreamHandler`` before each I/O wait."""

    def __init__(self, handler: BatchedStreamHandler) -> None:
        self.handler = handler

    def before_io_wait(self, timeout: float) -> None:
        if self.handler.pending:
            self.handler.flush()


def configure_logging(
    log_format: str = "text",
    level: str = "info",
    *,
    stream: IO[str] | None = None,
    secrets: Iterable[str] = (),
    batched: bool = False,
) -> logging.Handler:
    """Send trio_failover's logs to ``stream`` (stderr) in ``log_format`` at ``level``.

    Args:
        log_format: ``text`` or ``json``.
        level: ``debug``, ``info``, ``warning``, ``error`` or ``critical``.
        stream: where to write (default: ``sys.stderr`` at the time of the call).
        secrets: values to scrub from every line (see ``add_secrets``); they
            replace those of an earlier call.
        batched: install a ``BatchedStreamHandler``; the caller must flush it
            (run Trio with ``FlushLogs(handler)``, and flush at the end).

    Returns:
        The installed handler (it replaces any earlier one).
    """
    _secrets.clear()
    add_secrets(secrets)
    target = stream if stream is not None else sys.stderr
    handler = BatchedStreamHandler(target) if batched else logging.StreamHandler(target)
    handler.setFormatter(JSONFormatter() if log_format == "json" else TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    return handler
