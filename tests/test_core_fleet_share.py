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


def test_attempts_elsewhere_count_toward_max_in_flight() -> None:
    s: SlotScheduler[str] = SlotScheduler({"n": 2})
    s.configure_clients({"one": (1.0, 1)})
    assert s.shares.running_elsewhere({"one": 1, "free": 3}) is False
    assert "free" not in s.shares.clients  # no limit: its count changes nothing
    queued = s.acquire("w", "n", ready=set("n"), client="one")
    assert isinstance(queued, Queued)  # the node has room, the client has not
    assert s.shares.running_elsewhere({}) is True  # it ended there
    assert [handoff.waiter for handoff in s.dispatch(ready=set("n"))] == [queued.waiter]


def test_a_freed_slot_passes_a_client_at_its_limit_elsewhere() -> None:
    s: SlotScheduler[str] = SlotScheduler({"n": 1})
    s.configure_clients({"one": (1.0, 1)})
    taken = s.acquire("x", "n", ready=set("n"), client="x")
    assert isinstance(taken, Granted)
    one = s.acquire("w1", "n", ready=set("n"), client="one")
    two = s.acquire("w2", "n", ready=set("n"), client="two")
    assert isinstance(one, Queued)
    assert isinstance(two, Queued)
    s.shares.running_elsewhere({"one": 1})
    # Both idle here and of no use: "one" came first, but runs its one elsewhere.
    assert [h.waiter for h in s.release(taken.slot, ready=set("n"))] == [two.waiter]


def test_the_scan_passes_a_client_at_its_limit_elsewhere() -> None:
    s: SlotScheduler[str] = SlotScheduler({"n": 1, "m": 1})
    s.configure_clients({"one": (1.0, 1)})
    on_n = s.acquire("x", "n", ready=set("nm"), client="x")
    assert isinstance(on_n, Granted)
    assert isinstance(s.acquire("y", "m", ready=set("nm"), client="y"), Granted)
    # "two" is the idle pick (first in), but waits for m only: the scan looks further.
    assert isinstance(s.acquire("w2", "m", ready=set("nm"), client="two"), Queued)
    assert isinstance(s.acquire("w1", "n", ready=set("nm"), client="one"), Queued)
    s.shares.running_elsewhere({"one": 1})
    assert s.release(on_n.slot, ready=set("nm")) == []
