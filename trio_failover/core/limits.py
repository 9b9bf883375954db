"""Pure: each client's requests and tokens of the last minute, and its ``rpm``/``tpm`` limits.

A request that finds the last minute already holding ``rpm`` requests, or
``tpm`` tokens, of its client is refused (``429 rate_limited``) with the
whole seconds, rounded up, until the window has room; a refused request
counts toward nothing. A request counts at the instant it is admitted; its
tokens count at the instant its answer ends. An amount counted at ``t``
is in the window at ``now`` while ``now - t < WINDOW``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["RateBook", "Window", "retry_after"]

WINDOW = 60.0
"""Seconds of the sliding window."""


@dataclass(slots=True)
class Window:
    """Amounts counted at instants, oldest first, and their sum."""

    entries: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def expire(self, now: float) -> None:
        """Drop what left the window by ``now``."""
        entries = self.entries
        while entries and now - entries[0][0] >= WINDOW:
            self.total -= entries.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        """Count ``amount`` at ``now``."""
        if amount > 0:
            self.entries.append((now, amount))
            self.total += amount


def retry_after(window: Window, now: float, limit: int) -> int | None:
    """Whole seconds until ``window`` holds less than ``limit``; None when it does now.

    ``window`` must have been expired at ``now``. ``limit`` 0 limits nothing.
    """
    if not limit or window.total < limit:
        return None
    over = window.total - limit  # room needs more than this much to leave
    for at, amount in window.entries:
        over -= amount
        if over < 0:
            return max(math.ceil(at + WINDOW - now), 1)
    raise AssertionError("unreachable: the entries add up to the total")


class RateBook:
    """Every client's window of requests and of tokens."""

    def __init__(self) -> None:
        self._requests: dict[str, Window] = {}
        self._tokens: dict[str, Window] = {}

    def admit(self, client: str, now: float, rpm: int, tpm: int) -> int | None:
        """Admit a request of ``client`` at ``now`` (and count it), or say when to retry.

        Returns:
            None: admitted, counted in its requests' window. Else the
            ``Retry-After`` seconds: nothing was counted.
        """
        if not rpm and not tpm:
            return None
        requests = self._window(self._requests, client, now)
        tokens = self._window(self._tokens, client, now)
        waits = [w for w in (retry_after(requests, now, rpm), retry_after(tokens, now, tpm)) if w]
        if waits:
            return max(waits)
        if rpm:
            requests.add(now, 1)
        return None

    def charge(self, client: str, now: float, tokens: int) -> None:
        """``client``'s answer of ``tokens`` (prompt + completion) ended at ``now``."""
        if tokens > 0:
            self._window(self._tokens, client, now).add(now, tokens)

    def held(self, client: str, now: float) -> tuple[int, int]:
        """``(requests, tokens)`` of ``client`` in the window at ``now``."""
        requests = self._window(self._requests, client, now).total
        return requests, self._window(self._tokens, client, now).total

    def forget(self, now: float) -> None:
        """Drop the windows that are empty at ``now`` (clients named by a header come and go)."""
        for book in (self._requests, self._tokens):
            for name in list(book):
                book[name].expire(now)
                if not book[name].entries:
                    del book[name]

    @staticmethod
    def _window(book: dict[str, Window], client: str, now: float) -> Window:
        window = book.get(client)
        if window is None:
            window = book[client] = Window()
        window.expire(now)
        return window
