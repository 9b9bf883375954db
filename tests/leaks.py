"""Helpers of the tests that search everything the proxy writes for a secret.

Used by ``test_auth_secrets.py`` (client keys, admin token) and
``test_credentials.py`` (per-node keys); the ``printed_logs`` fixture in
``conftest.py`` attaches ``PrintedLogs`` for a test.
"""

from __future__ import annotations

import io
import json
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import attrs

from trio_failover.telemetry.logs import JSONFormatter, TextFormatter


class RawRecords(logging.Handler):
    """Every record as text, its fields and exception included, before any scrubbing."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        line = f"{record.getMessage()} {json.dumps(fields, default=str)}"
        if record.exc_info:
            line += "\n" + logging.Formatter().formatException(record.exc_info)
        self.lines.append(line)


@attrs.frozen
class PrintedLogs:
    """The raw records, and the same records as the text and the JSON format print them."""

    raw: RawRecords
    text: io.StringIO
    json: io.StringIO


@contextmanager
def capture_logs() -> Iterator[PrintedLogs]:
    """Attach ``PrintedLogs`` to the ``trio_failover`` logger at DEBUG while inside."""
    logs = PrintedLogs(RawRecords(), io.StringIO(), io.StringIO())
    text, json_lines = logging.StreamHandler(logs.text), logging.StreamHandler(logs.json)
    text.setFormatter(TextFormatter())
    json_lines.setFormatter(JSONFormatter())
    log = logging.getLogger("trio_failover")
    level = log.level
    for handler in (logs.raw, text, json_lines):
        log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield logs
    finally:
        for handler in (logs.raw, text, json_lines):
            log.removeHandler(handler)
        log.setLevel(level)


def closed_port() -> int:
    """A local port with nothing listening (connects are refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
