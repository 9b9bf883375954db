"""The server's drain, as the client connections see it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio


class Drain:
    """The server's drain: once begun, idle keep-alive waits end and answers close."""

    def __init__(self) -> None:
        self.active = False
        self._idle_scopes: set[trio.CancelScope] = set()

    def begin(self) -> None:
        """Stop taking new requests: idle keep-alive connections close now."""
        self.active = True
        for scope in list(self._idle_scopes):
            scope.cancel()

    @contextlib.contextmanager
    def idle(self, timeout: float) -> Iterator[trio.CancelScope]:
        """A wait of at most ``timeout`` that the drain cuts short (at once, if begun)."""
        with trio.move_on_after(timeout) as scope:
            # An idle connection holds up no drain: begin() cancels it.
            self._idle_scopes.add(scope)
            try:
                if self.active:
                    scope.cancel()
                yield scope
            finally:
                self._idle_scopes.discard(scope)
