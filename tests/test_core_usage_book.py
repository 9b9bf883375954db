"""The usage tally: per client and model, since start and in the last hour."""

from __future__ import annotations

from typing import Any

import pytest

from trio_failover.core import usage_book
from trio_failover.core.usage_book import OTHER, UsageBook


def add(book: UsageBook, client: str, model: str | None, now: float, **kw: Any) -> str | None:
    values = {"prompt": 10, "completion": 5, "estimated": False, "slot_seconds": 1.5}
    values.update(kw)
    return book.add(client, model, now=now, **values)


def test_one_entry_per_client_and_model_latest_folded() -> None:
    book = UsageBook()
    add(book, "alice", "llama3.2", 0.0)
    add(book, "alice", "llama3.2:latest", 1.0, estimated=True)
    add(book, "bob", "llama3.2", 2.0, prompt=1, completion=2, slot_seconds=0.25)
    add(book, "alice", None, 3.0, prompt=0, completion=0, slot_seconds=0.0)
    document = book.document(now=3.0)
    hour = {"requests": 2, "prompt_tokens": 20, "completion_tokens": 10, "estimated": 1}
    assert document["clients"] == [
        {"client": "alice", "model": None, "requests": 1, "prompt_tokens": 0,
         "completion_tokens": 0, "estimated": 0, "slot_seconds": 0.0,
         "last_hour": {"requests": 1, "prompt_tokens": 0, "completion_tokens": 0,
                       "estimated": 0, "slot_seconds": 0.0}},
        {"client": "alice", "model": "llama3.2", **hour, "slot_seconds": 3.0,
         "last_hour": {**hour, "slot_seconds": 3.0}},
        {"client": "bob", "model": "llama3.2", "requests": 1, "prompt_tokens": 1,
         "completion_tokens": 2, "estimated": 0, "slot_seconds": 0.25,
         "last_hour": {"requests": 1, "prompt_tokens": 1, "completion_tokens": 2,
                       "estimated": 0, "slot_seconds": 0.25}},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("later", "in_hour"),
    [
        (90.0, 2),  # the same minute as the second
        (3599.0, 2),  # minute 59 after minute 0: still within the hour
        (3600.0, 1),  # minute 60: minute 0 has left the hour
        (7200.0, 0),
    ],
)
def test_last_hour_by_minutes(later: float, in_hour: int) -> None:
    book = UsageBook()
    add(book, "a", "m", 0.0)
    add(book, "a", "m", 90.0)  # minute 1
    entry = book.document(now=later)["clients"][0]
    assert entry["requests"] == 2
    assert entry["last_hour"]["requests"] == in_hour


def test_minutes_are_bounded() -> None:
    book = UsageBook()
    for minute in range(200):
        add(book, "a", "m", minute * 60.0)
    entry = book._entries[("a", "m:latest")]
    assert len(entry.minutes) == usage_book.HOUR_MINUTES
    assert book.document(now=199 * 60.0)["clients"][0]["last_hour"]["requests"] == 60


def test_entries_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage_book, "MOST_ENTRIES", 2)
    book = UsageBook()
    for model in ("a", "b", "c", "d"):
        add(book, "x", model, 0.0)
    assert add(book, "x", "a:latest", 0.0) == "a"
    assert add(book, "x", "e", 0.0) == OTHER
    models = [entry["model"] for entry in book.document(now=0.0)["clients"]]
    assert models == [OTHER, "a", "b"]
    assert book.document(now=0.0)["clients"][0]["requests"] == 3
