"""The demo's output: plain lines and tables, and the live view of the proxy's events."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

import trio

from ..proxy.proxy import Proxy
from ..telemetry.logs import logger
from ..testing import ClientResponse

Event = dict[str, Any]


# -- output -------------------------------------------------------------------

_ANSI = {"bold": "\x1b[1m", "green": "\x1b[32m", "red": "\x1b[31m", "dim": "\x1b[2m"}


class Screen:
    """Plain lines on a text stream, with a little colour on a terminal only."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        isatty = getattr(stream, "isatty", None)
        self.colour = bool(
            isatty is not None
            and isatty()
            and "NO_COLOR" not in os.environ
            and os.environ.get("TERM") != "dumb"
        )

    def style(self, text: str, style: str) -> str:
        if not self.colour:
            return text
        return f"{_ANSI[style]}{text}\x1b[0m"

    def line(self, text: str = "") -> None:
        # Flushed line by line: the demo is watched live, often through a pipe.
        print(text, file=self.stream, flush=True)

    def heading(self, text: str) -> None:
        self.line()
        self.line(self.style(text, "bold"))

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]], indent: int = 4) -> None:
        """Columns two spaces apart; a column whose header starts with '>' is right-aligned."""
        names = [name.lstrip(">") for name in header]
        right = [name.startswith(">") for name in header]
        cells = [names, *[list(row) for row in rows]]
        widths = [max(len(row[column]) for row in cells) for column in range(len(names))]
        for number, row in enumerate(cells):
            text = "  ".join(
                cell.rjust(width) if flush_right else cell.ljust(width)
                for cell, width, flush_right in zip(row, widths, right, strict=True)
            ).rstrip()
            self.line(" " * indent + (self.style(text, "dim") if number == 0 else text))


@contextmanager
def quiet_proxy_logs() -> Iterator[None]:
    """Keep the proxy's own log lines (failover warnings...) out of the demo's view.

    The demo prints the same facts from the proxy's events; errors still
    reach stderr. The logger is restored afterwards, for callers in tests.
    """
    saved = (logger.level, list(logger.handlers), logger.propagate)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("trio-failover: %(levelname)s %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.ERROR)
    logger.propagate = False
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]


# -- the live view --------------------------------------------------------------


class Watcher:
    """Prints the proxy's events as they come, and keeps what the script checks.

    Workload lines are timed from the start of their request, node lines from
    the latest mark (the script sets one at each step).
    """

    def __init__(self, screen: Screen, proxy: Proxy) -> None:
        self.screen = screen
        self.proxy = proxy
        self.mark = trio.current_time()
        self.started: dict[str, float] = {}
        self.finished: dict[str, Event] = {}
        self.node_events: list[Event] = []
        self.announce = False  # print a line when a request arrives (once serving)
        self._changed = trio.Event()
        self._notes: list[str] = []  # lines of the script's own, not yet printed
        self._waiting: trio.CancelScope | None = None
        self._running = False

    async def run(self) -> None:
        # One task prints everything, events first: an event published before
        # the client's bytes went out may already be handed to this task (a
        # memory channel gives it to the waiting receiver at once) when the
        # client, scheduled in the same batch, sees those bytes. So the script
        # leaves its lines here (``note``) instead of printing them itself.
        self._running = True
        try:
            with self.proxy.events.subscribe(buffer=0) as events:
                while True:
                    with trio.CancelScope() as self._waiting:
                        try:
                            event = await events.receive.receive()
                        except (trio.EndOfChannel, trio.ClosedResourceError):
                            return
                        self.show(event)
                        # Wake whoever waits for a condition on what was seen so far.
                        self._changed.set()
                        self._changed = trio.Event()
                    self._waiting = None
                    self._print_notes()
        finally:
            self._running = False
            self._print_notes()

    def note(self, since: float, text: str) -> None:
        """Print a line of the script's, after every event published before it."""
        line = self._timed(since, text)
        if not self._running:
            self.screen.line(line)
            return
        self._notes.append(line)
        if self._waiting is not None:
            self._waiting.cancel()  # an event already handed over is still shown first

    def _print_notes(self) -> None:
        notes, self._notes = self._notes, []
        for line in notes:
            self.screen.line(line)

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds after some event."""
        while not condition():
            await self._changed.wait()

    async def wait_finished(self, workload: str) -> Event:
        """The final event of ``workload`` (completed, failed or cancelled)."""
        await self.wait_for(lambda: workload in self.finished)
        return self.finished[workload]

    def say(self, since: float, text: str) -> None:
        self.screen.line(self._timed(since, text))

    def _timed(self, since: float, text: str) -> str:
        offset = f"+{trio.current_time() - since:.3f} s"
        return f"  {self.screen.style(offset.rjust(10), 'dim')}  {text}"

    def show(self, event: Event) -> None:
        if event.get("type") not in ("node", "workload"):
            return  # checks, reloads: not part of the script's story
        if event.get("type") == "node":
            self.node_events.append(event)
            if event["state"] == "cooling":
                text = (
                    f"{event['node']} cools down for {event['until_s']:.1f} s ({event['reason']})"
                )
            else:
                text = f"{event['node']} is ready again ({event['reason']})"
            self.say(self.mark, text)
            return
        workload, state = event["id"], event["state"]
        if state == "queued":
            self.started[workload] = self.mark = trio.current_time()
            if self.announce:
                self.screen.line()
                self.screen.line(f"  request {workload}")
            return
        since = self.started.get(workload, self.mark)
        if state == "running":
            self.say(since, f"attempt {event['attempt']} -> {event['node']}")
        elif state == "committed":
            self.say(since, f"commit: {event['node']}'s response starts reaching the client")
        else:
            self.finished[workload] = event
            self.say(since, self._outcome_line(event))
            self.attempts_table(event)
            self.nodes_table()

    def _outcome_line(self, event: Event) -> str:
        state = event["state"]
        if state == "completed":
            return f"completed: {event['status']} from {event['node']}"
        if state == "cancelled":
            return "cancelled: the client left"
        return f"failed: the client got {event['status']}"

    def attempts_table(self, event: Event) -> None:
        rows = [
            (str(number), item["node"], item["outcome"], f"{item['elapsed_ms']:.0f} ms")
            for number, item in enumerate(event["attempts"], start=1)
        ]
        self.screen.table(("attempt", "node", "outcome", ">elapsed"), rows)

    def nodes_table(self) -> None:
        rows = []
        for node in self.proxy.status()["nodes"]:
            cooling = node["state"] == "cooling"
            rows.append(
                (
                    node["name"],
                    node["state"],
                    f"{node['cooldown_remaining_s']:.1f} s ({node['reason']})" if cooling else "-",
                    str(node["served"]),
                    str(node["failed"]),
                )
            )
        self.screen.table(("node", "state", "cooldown", ">served", ">failed"), rows)


def answer_line(response: ClientResponse) -> str:
    """The assistant's text of a chat completion (JSON or SSE), for one line."""
    if not response.complete:
        return "(incomplete)"
    text = "".join(sse_tokens(response.body))
    if not text:
        try:
            text = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = response.body[:60].decode("utf-8", "replace")
    return repr(text.strip())


def sse_tokens(data: bytes) -> list[str]:
    """The content deltas in server-sent events of a chat completion stream."""
    tokens = []
    for line in data.splitlines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            delta = json.loads(line[6:])["choices"][0]["delta"]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        if isinstance(delta, dict) and delta.get("content"):
            tokens.append(str(delta["content"]))
    return tokens
