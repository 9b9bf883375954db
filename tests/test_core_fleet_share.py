"""core/fleet_share.py: fleet-wide standing and whether a freed slot waits for another replica."""

from __future__ import annotations

import math

import pytest

from trio_failover.core.fleet_share import (
    ClientShare,
    ShareSummary,
    Standing,
    defer_to_fleet,
    fleet_standing,
)
from trio_failover.core.slots import Granted, Queued, SlotScheduler


def test_standing_sums_the_replicas_and_counts_a_client_once_per_replica() -> None:
    remote = [
        ShareSummary((ClientShare("a", 1, 2, 1, 3.0), ClientShare("a", 2, 1, 1, 3.0))),
        ShareSummary((ClientShare("a", 1, 0, 2, 1.0), ClientShare("b", 1, 4, 0, 0.0))),
    ]
    standing = fleet_standing({"a": (1, 2.0)}, remote, {"b": (2.0, 3)})
    assert standing == {"a": Standing(4, 6.0), "b": Standing(0, 0.0, 2.0, 3)}


def summary(*shares: ClientShare) -> ShareSummary:
    return ShareSummary(shares)


FLOOD = {"a": Standing(2, 10.0)}
# (this replica's best waiter, the others' summaries, the standing, defer?)
CASES = [
    # Nobody waits here: nothing to defer.
    (None, [summary(ClientShare("b", 1, 1, 0, 0.0))], {}, False),
    # Nobody waits elsewhere.
    ((1, "a"), [], FLOOD, False),
    (
        (1, "a"),
        [summary(ClientShare("b", 1, 0, 1, 0.0))],
        {**FLOOD, "b": Standing(1, 0.0)},
        False,
    ),
    # b runs nothing fleet-wide, a floods: b's.
    ((1, "a"), [summary(ClientShare("b", 1, 1, 0, 0.0))], FLOOD, True),
    # The same client waiting elsewhere: ours serves it as well.
    ((1, "a"), [summary(ClientShare("a", 1, 5, 0, 0.0))], FLOOD, False),
    # A higher priority elsewhere wins even with more use...
    ((1, "a"), [summary(ClientShare("b", 0, 1, 3, 50.0))], {**FLOOD, "b": Standing(3, 50.0)}, True),
    # ...a lower one never.
    ((1, "a"), [summary(ClientShare("b", 2, 1, 0, 0.0))], FLOOD, False),
    # Both run: lower use ÷ weight wins; equal is no reason to wait.
    ((1, "a"), [summary(ClientShare("b", 1, 1, 1, 4.0))], {**FLOOD, "b": Standing(1, 4.0)}, True),
    (
        (1, "a"),
        [summary(ClientShare("b", 1, 1, 1, 10.0))],
        {**FLOOD, "b": Standing(2, 10.0)},
        False,
    ),
    # Weight: b's 30 over weight 4 is below a's 10.
    (
        (1, "a"),
        [summary(ClientShare("b", 1, 1, 1, 30.0))],
        {**FLOOD, "b": Standing(1, 30.0, 4.0)},
        True,
    ),
    # b at its max_in_flight fleet-wide takes nothing.
    (
        (1, "a"),
        [summary(ClientShare("b", 1, 1, 1, 0.0))],
        {**FLOOD, "b": Standing(1, 0.0, 1.0, 1)},
        False,
    ),
    # Our waiter runs nothing and b runs something: ours.
    ((1, "c"), [summary(ClientShare("b", 1, 1, 1, 0.1))], {"b": Standing(1, 0.1)}, False),
]


@pytest.mark.parametrize(("local", "remote", "standing", "defer"), CASES)
def test_defer_to_fleet(
    local: tuple[int, str] | None,
    remote: list[ShareSummary],
    standing: dict[str, Standing],
    defer: bool,
) -> None:
    assert defer_to_fleet(local, remote, standing) is defer


def test_the_scheduler_tells_its_clients_and_the_waiter_it_would_serve_first() -> None:
    s: SlotScheduler[str] = SlotScheduler({"n": 1})
    assert s.best_waiting(0.0) is None
    assert isinstance(s.acquire("a1", "n", ready=set("n"), client="a", now=0.0), Granted)
    for token, client, rank in (("a2", "a", 1), ("b1", "b", 1), ("c1", "c", 2)):
        assert isinstance(
            s.acquire(token, "n", ready=set("n"), client=client, rank=rank, now=0.0), Queued
        )
    # b runs nothing: it goes before a, which runs one; c is of a lower priority.
    assert s.best_waiting(10.0) == (1, "b")
    assert s.share_summary(10.0) == [
        ("a", 1, 1, 1, pytest.approx(60 / math.log(2) * (1 - 2 ** (-10 / 60)))),
        ("b", 1, 1, 0, 0.0),
        ("c", 2, 1, 0, 0.0),
    ]
    s.fair = False  # first come, first served: the longest-waiting
    assert s.best_waiting(10.0) == (1, "a")
