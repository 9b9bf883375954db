"""The workers of a ``--workers`` fleet, as the first worker's ``/status`` lists them.

Only the supervisor knows its workers; at each start, serve and exit it
writes the whole list, one JSON line, to a pipe whose read end the first
worker holds, and a thread of that worker keeps the last line. Why a pipe
and whole snapshots, and why the ages are read at each ``/status`` from
``/proc/PID/stat``: docs/replicas.md ("Workers").

A worker runs one roster at most; ``install`` makes it the process's, and
the admin listener asks ``listed()`` (None in a proxy without workers, whose
``/status`` then has no ``workers`` key).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

__all__ = ["Roster", "WorkerEntry", "encode", "install", "listed", "send"]

# Lines longer than this could arrive in pieces (or be dropped in part).
LINE_MOST = select.PIPE_BUF


@attrs.define
class WorkerEntry:
    """One worker, as the supervisor knows it."""

    index: int
    pid: int | None = None  # None between a death and the next start
    restarts: int = 0  # how many times it was started again
    serving: bool = False  # it said it serves, and has not exited since

    def document(self) -> dict[str, Any]:
        return attrs.asdict(self)


def encode(entries: list[WorkerEntry]) -> bytes:
    """The line the supervisor sends: every worker, by index."""
    line = json.dumps([entry.document() for entry in sorted(entries, key=lambda e: e.index)])
    return line.encode() + b"\n"


def send(fd: int, line: bytes) -> bool:
    """Write ``line`` to the non-blocking pipe ``fd``, whole or not at all; whether it went.

    A full pipe (the worker reads nothing) or a closed one (it died) drops
    the line: the next one carries the whole list again.
    """
    if len(line) > LINE_MOST:
        return False
    try:
        return os.write(fd, line) == len(line)
    except (BlockingIOError, BrokenPipeError):
        return False


def uptime_s(pid: int, proc: Path = Path("/proc")) -> float | None:
    """Seconds since process ``pid`` started, from the kernel; None if it cannot tell."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rpartition(")")[2].split()
        since_boot = float((proc / "uptime").read_text().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, IndexError, ValueError):
        return None
    return round(max(0.0, since_boot - started), 1)


class Roster:
    """The first worker's copy of the supervisor's list."""

    def __init__(self) -> None:
        self._latest: list[dict[str, Any]] = []
        self._on_take: Callable[[], None] | None = None  # ``others_gone``'s wake-up

    def take(self, line: bytes) -> None:
        """One line from the supervisor; a line that does not parse is ignored."""
        with contextlib.suppress(ValueError):
            entries = json.loads(line)
            if isinstance(entries, list):
                self._latest = entries  # one assignment: the admin thread sees old or new
                wake = self._on_take
                if wake is not None:
                    wake()

    def others_running(self) -> bool:
        """Whether the supervisor lists a process for any worker but the first."""
        return any(
            entry.get("pid") is not None
            for entry in self._latest
            if isinstance(entry, dict) and entry.get("index") != 0
        )

    async def others_gone(self) -> None:
        """Return once no worker but the first has a process (the caller bounds the wait).

        The first worker, drained, keeps the fleet's admin listener while
        the others drain (``/healthz`` says ``503``, not a refusal). Each
        line the follower thread takes wakes this task through Trio.
        """
        token = trio.lowlevel.current_trio_token()
        try:
            while True:  # one turn per roster line, until the caller's deadline
                changed = trio.Event()

                def wake(changed: trio.Event = changed) -> None:
                    with contextlib.suppress(trio.RunFinishedError):
                        trio.from_thread.run_sync(changed.set, trio_token=token)

                self._on_take = wake
                if not self.others_running():  # also a line taken before the hook was set
                    return
                await changed.wait()
        finally:
            self._on_take = None

    def follow(self, fd: int) -> None:
        """In a thread: read lines from ``fd`` until the supervisor's end closes."""
        buffer = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 65536):
                *lines, buffer = (buffer + chunk).split(b"\n")
                if lines:
                    self.take(lines[-1])
        with contextlib.suppress(OSError):
            os.close(fd)

    def document(self) -> list[dict[str, Any]]:
        """The ``workers`` list of ``/status``: each worker with its age (``uptime_s``)."""
        listed = []
        for entry in self._latest:
            pid = entry.get("pid")
            age = uptime_s(pid) if isinstance(pid, int) else None
            listed.append({**entry, "uptime_s": age})
        return listed


_installed: list[Roster] = []


def install(roster: Roster) -> None:
    """Make ``roster`` this process's (a worker's ``main`` does, once)."""
    _installed[:] = [roster]


def listed() -> list[dict[str, Any]] | None:
    """The workers for ``/status``, or None when this process is no fleet's first worker."""
    return _installed[0].document() if _installed else None
