"""Where each value came from (``Source``), and the mistakes found on the way (``Mistakes``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import attrs

from ...core.errors import ConfigError, ConfigErrors

__all__ = ["DEFAULT", "Mistakes", "Source", "SourceKind"]

SourceKind = Literal["flag", "env", "file", "default"]


@attrs.frozen
class Source:
    """Where one setting came from.

    ``where`` is the flag (``--listen``), the environment variable
    (``TRIO_FAILOVER_LISTEN``) or ``FILE:LINE``; empty for a default.
    ``raw`` is the value as given there, kept to quote it in errors.
    """

    kind: SourceKind
    where: str = ""
    raw: object = None

    def __str__(self) -> str:
        return self.kind if self.kind == "default" else f"{self.kind} {self.where}"


DEFAULT = Source("default")


class Mistakes:
    """The errors found so far; ``resolve`` raises them all at the end."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def __len__(self) -> int:
        return len(self.found)

    def add(self, error: ConfigError) -> None:
        self.found.extend(error.errors if isinstance(error, ConfigErrors) else (error,))

    @contextlib.contextmanager
    def catch(self) -> Iterator[None]:
        """Record a ``ConfigError`` raised inside the block and go on after it."""
        try:
            yield
        except ConfigError as exc:
            self.add(exc)

    def raise_if_any(self, file_name: str | None) -> None:
        """Raise the one error, or all of them: flags and environment first, then by line."""
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise ConfigErrors(sorted(self.found, key=lambda error: _line_of(error, file_name)))


def _line_of(error: ConfigError, file_name: str | None) -> tuple[int, int]:
    """The sort key of an error: flags and environment, the file's lines, then the whole file."""
    if file_name is None or not error.source.startswith(file_name):
        return (0, 0)
    line = error.source[len(file_name) :].removeprefix(":")
    # An error of the file as a whole (no node in it) comes after the lines:
    # it is often the consequence of one of them ([[upstreams]]).
    return (1, int(line)) if line.isdigit() else (2, 0)
