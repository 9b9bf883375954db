"""Logging set-up: text or JSON lines on stderr, and the one wall clock.

Log calls pass structured fields as ``extra={"fields": {...}}``; the text
format prints them as ``key=value``, the JSON format as object members.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

logger = logging.getLogger("trio_failover")
access_logger = logging.getLogger("trio_failover.access")


def wall_time() -> float:
    """Unix time, for log stamps and HTTP dates only (never for deadlines)."""
    return time.time()


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    """``2026-11-29T20:00:00Z INFO message key=value ...``"""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
        parts = [stamp, record.levelname, record.getMessage()]
        parts += [f"{key}={_text(value)}" for key, value in _fields(record).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return json.dumps(text) if (" " in text or not text) else text


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the fields."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        document.update(_fields(record))
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """Send trio_failover's logs to stderr in ``log_format`` at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if log_format == "json" else TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
