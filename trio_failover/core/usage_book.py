"""Pure: the tally of usage per client and model, since start and in the last hour.

``UsageBook.add`` counts one finished workload: a request, its tokens (if
known), whether they were estimated, and the seconds its attempts held
slots. ``document`` is the admin route ``GET /usage``.

A model is the name the client asked for, ``NAME`` and ``NAME:latest`` as
one (``names.model_key``), shown as first asked. The last hour is kept in
minute buckets, at most 60 per entry, so memory stays bounded by the
entries; and the entries by ``MOST_ENTRIES``: a client's body names its
model freely, and a node that serves any name would let each request make
a new one. Past that many, a new pair is counted under the model
``OTHER`` (its client kept): the tokens metric uses the same label.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from .names import model_key

Pair = tuple[str, "str | None"]
"""A client and a model's key (``names.model_key``; None: the request named no model)."""

MOST_ENTRIES = 1000
OTHER = "(other)"  # the model of the pairs past MOST_ENTRIES
MINUTE = 60.0
HOUR_MINUTES = 60


@attrs.define
class Counts:
    """What one client used of one model in some span of time."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated: int = 0
    slot_seconds: float = 0.0

    def add(self, prompt: int, completion: int, estimated: bool, slot_seconds: float) -> None:
        """One more request and what it used."""
        self.requests += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.estimated += estimated
        self.slot_seconds += slot_seconds

    def merge(self, other: Counts) -> None:
        """Add ``other``'s counts to these."""
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.estimated += other.estimated
        self.slot_seconds += other.slot_seconds

    def to_json(self) -> dict[str, Any]:
        """The counts as ``GET /usage`` shows them (slot-seconds to 1 ms)."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "estimated": self.estimated,
            "slot_seconds": round(self.slot_seconds, 3),
        }


@attrs.define
class Entry:
    """One client's use of one model: the total, and the minutes of the last hour."""

    client: str
    model: str | None  # as first asked; None: the request named no model
    total: Counts = attrs.Factory(Counts)
    # (minute number, counts), oldest first, at most HOUR_MINUTES of them.
    minutes: list[tuple[int, Counts]] = attrs.Factory(list)

    def add(
        self, prompt: int, completion: int, estimated: bool, slot_seconds: float, now: float
    ) -> None:
        """Count one request at ``now`` (Trio seconds)."""
        self.total.add(prompt, completion, estimated, slot_seconds)
        minute = int(now // MINUTE)
        if not self.minutes or self.minutes[-1][0] != minute:
            self.minutes.append((minute, Counts()))
            del self.minutes[:-HOUR_MINUTES]
        self.minutes[-1][1].add(prompt, completion, estimated, slot_seconds)

    def last_hour(self, now: float) -> Counts:
        """The counts of the minutes that began within the hour before ``now``."""
        since = int(now // MINUTE) - HOUR_MINUTES
        hour = Counts()
        for minute, counts in self.minutes:
            if minute > since:
                hour.merge(counts)
        return hour


class UsageBook:
    """The usage of every client and model since start."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str | None], Entry] = {}

    def add(
        self,
        client: str,
        model: str | None,
        *,
        prompt: int,
        completion: int,
        estimated: bool,
        slot_seconds: float,
        now: float,
    ) -> str | None:
        """Count one finished request of ``client`` for ``model`` at ``now``.

        Returns:
            The model it was counted under (the tokens metric's label).
        """
        key = (client, None if model is None else model_key(model))
        entry = self._entries.get(key)
        if entry is None:
            shown = model if len(self._entries) < MOST_ENTRIES else OTHER
            key = (client, None if shown is None else model_key(shown))
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = Entry(client, shown)
        entry.add(prompt, completion, estimated, slot_seconds, now)
        return entry.model

    def document(self, now: float) -> dict[str, Any]:
        """``GET /usage``: one entry per client and model, by client then model."""
        return usage_document(
            (entry.client, entry.model, entry.total, entry.last_hour(now))
            for entry in self._entries.values()
        )


def usage_document(entries: Iterable[tuple[str, str | None, Counts, Counts]]) -> dict[str, Any]:
    """``GET /usage`` of ``(client, model, since start, last hour)``, by client then model."""
    return {
        "clients": [
            {"client": client, "model": model, **total.to_json(), "last_hour": hour.to_json()}
            for client, model, total, hour in sorted(entries, key=lambda e: (e[0], e[1] or ""))
        ]
    }
