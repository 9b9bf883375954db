"""Fixtures shared by the test files."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from leaks import PrintedLogs, capture_logs


class LogRecords(logging.Handler):
    """Keeps every record of the ``trio_failover`` loggers.

    Attached to the package logger itself, so it works whatever a test did
    to propagation (``configure_logging`` turns it off, which blinds caplog).
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[logging.LogRecord]:
        """The records of exactly ``level``."""
        return [record for record in self.records if record.levelno == level]

    def messages(self, level: int) -> list[str]:
        """The messages of the records of exactly ``level``."""
        return [record.getMessage() for record in self.at(level)]


@pytest.fixture
def logged() -> Iterator[LogRecords]:
    """Every log record of the proxy during the test, at DEBUG and above."""
    handler = LogRecords()
    log = logging.getLogger("trio_failover")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
def printed_logs() -> Iterator[PrintedLogs]:
    """Every log record, raw and as both formats print it (``leaks.PrintedLogs``)."""
    with capture_logs() as logs:
        yield logs
