"""Helpers shared by the test files: the proxy's command line in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import trio


class Lines(list[str]):
    """A process's stderr lines so far; ``wait_for`` waits for one to come."""

    def __init__(self) -> None:
        super().__init__()
        self._added = trio.Event()

    def append(self, line: str) -> None:
        super().append(line)
        self._added.set()
        self._added = trio.Event()

    async def wait_for(self, text: str, after: int = 0) -> str:
        """The first line containing ``text`` (from line ``after`` on), once it has been written.

        Bound it with ``trio.fail_after``: a line that never comes waits forever.
        """
        seen = after
        while True:
            for line in self[seen:]:
                if text in line:
                    return line
            seen = len(self)
            await self._added.wait()


@attrs.define
class ProxyProcess:
    process: trio.Process
    address: tuple[str, int]
    lines: Lines


@asynccontextmanager
async def serve_process(
    *options: str,
    preexec_fn: Callable[[], None] | None = None,
    command: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[ProxyProcess]:
    """``trio-failover serve`` in a subprocess, listening on a free port.

    ``command`` replaces the whole command line (``options`` then unused),
    e.g. an installed program whose listeners ``env`` sets.
    Yields once the proxy logged ``listening on``; kills it on the way out.
    """
    if command is None:
        command = [
            sys.executable,
            "-m",
            "trio_failover",
            "serve",
            "--listen=127.0.0.1:0",
            "--admin-listen=off",
            *options,
        ]
    process = await trio.lowlevel.open_process(
        list(command),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=preexec_fn,
        env=env,
    )
    lines = Lines()
    listening = trio.Event()
    address: list[tuple[str, int]] = []

    async def read_stderr() -> None:
        assert process.stderr is not None
        buffer = b""
        while chunk := await process.stderr.receive_some(65536):
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            for raw in done:
                line = raw.decode(errors="replace")
                lines.append(line)
                # Text or JSON lines: the address ends at a blank or a quote.
                found = re.search(r"listening on http://(\S+?):(\d+)\b", line)
                if found:
                    address.append((found[1], int(found[2])))
                    listening.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stderr)
            with trio.fail_after(15):
                await listening.wait()
            yield ProxyProcess(process, address[0], lines)
            nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
