"""Table-driven tests of capacity, the queue and load-aware order (trio_failover.core.slots).

Every case is plain data: node names are single letters, a ledger is written
as capacities (``"a1 b2"``, unnamed nodes unlimited) and slots in flight, one
letter per slot (``"aab"``); the nodes not ready are a string too. No clock,
no I/O.
"""

from __future__ import annotations

import ast
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_failover.core.slots import (
    Balance,
    Exhausted,
    Granted,
    Handoff,
    NodeFull,
    QueueBudget,
    Queued,
    QueueFull,
    Slot,
    SlotLedger,
    SlotScheduler,
    Take,
    Wait,
    Waiter,
    choose_node,
)

NODES = "abcd"


def _capacities(caps: str) -> dict[str, int]:
    given_caps = {item[0]: int(item[1:]) for item in caps.split()}
    return {node: given_caps.get(node, 0) for node in NODES}


def _ledger(caps: str, busy: str) -> SlotLedger:
    ledger = SlotLedger(_capacities(caps))
    for node in busy:
        ledger.take(node)
    return ledger


def _ready(not_ready: str) -> set[str]:
    return set(NODES) - set(not_ready)


# -- the order of one attempt -----------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    order: str  # the resolved candidates
    expected: str  # "b" = take b, "wait:ab", or "none"
    caps: str = ""
    busy: str = ""
    cooling: str = ""  # cooling or down: not ready
    tried: str = ""
    balance: Balance = "priority"
    preferred: str | None = None


CASES = [
    # Capacity 0 everywhere: today's order, nothing ever waits.
    Case("cap0-first", "abcd", "a"),
    Case("cap0-busy-never-full", "abc", "a", busy="aaaab"),
    Case("cap0-next-untried", "abc", "b", tried="a"),
    Case("cap0-cooling-last", "bca", "b", cooling="a"),
    Case("cap0-partitions-again", "abc", "b", cooling="a"),
    Case("cap0-cooling-after-ready-tried", "bca", "a", cooling="a", tried="bc"),
    Case("cap0-all-cooling-in-order", "abc", "a", cooling="abc"),
    Case("cap0-all-tried", "abc", "none", tried="abc"),
    Case("no-candidates", "", "none"),
    Case("tried-outside-order-ignored", "ab", "a", tried="cd"),
    # priority: fill the first, spill to the next.
    Case("priority-fill-first", "ab", "a", caps="a1 b1"),
    Case("priority-spill", "ab", "b", caps="a1 b1", busy="a"),
    Case("priority-spill-skips-full", "abc", "c", caps="a2 b1 c1", busy="aab"),
    Case("priority-not-by-load", "ab", "a", caps="a4 b4", busy="aaa"),
    Case("priority-all-full-waits", "ab", "wait:ab", caps="a1 b1", busy="ab"),
    Case("priority-unlimited-after-full", "abc", "b", caps="a1", busy="abbb"),
    # Never a cooling or down node while an untried ready one exists.
    Case("full-ready-beats-free-cooling", "abc", "wait:ab", caps="a1 b1", busy="ab", cooling="c"),
    Case("full-ready-beats-free-down", "cab", "wait:ab", caps="a1 b1", busy="ab", cooling="c"),
    Case(
        "tried-free-does-not-count", "abc", "wait:b", caps="a1 b1", busy="b", tried="a", cooling="c"
    ),
    Case("cooling-after-ready-tried", "abc", "c", caps="a1 b1", busy="b", tried="ab", cooling="c"),
    Case("all-cooling-used-in-order", "abc", "b", caps="a1", busy="a", cooling="abc"),
    Case("all-cooling-full-waits", "ab", "wait:ab", caps="a1 b1", busy="ab", cooling="ab"),
    Case(
        "untried-cooling-full-waits", "abc", "wait:c", caps="c1", busy="c", tried="ab", cooling="c"
    ),
    # least-loaded: lowest in_flight / max(capacity, 1), ties in resolved order.
    Case("least-lowest", "abc", "c", caps="a2 b2 c2", busy="aab", balance="least-loaded"),
    Case("least-ratio-not-count", "ab", "a", caps="a4 b2", busy="ab", balance="least-loaded"),
    Case("least-small-node-idle", "ab", "b", caps="a4 b1", busy="aaa", balance="least-loaded"),
    Case("least-tie-first", "ab", "a", caps="a4 b2", busy="aab", balance="least-loaded"),
    Case("least-tie-resolved-order", "cba", "c", caps="a2 b2 c2", balance="least-loaded"),
    Case("least-skips-full", "ab", "b", caps="a1 b4", busy="abbb", balance="least-loaded"),
    Case("least-cap0-counts", "abc", "c", busy="aab", balance="least-loaded"),
    Case("least-all-full-waits", "ab", "wait:ab", caps="a1 b1", busy="ab", balance="least-loaded"),
    Case(
        "least-never-idle-cooling",
        "abc",
        "a",
        caps="a2 b2 c2",
        busy="ab",
        cooling="c",
        balance="least-loaded",
    ),
    Case(
        "least-ignored-all-cooling",
        "abc",
        "a",
        caps="a2 b2 c2",
        busy="a",
        cooling="abc",
        balance="least-loaded",
    ),
    # A preferred node (selection, affinity) first while it has a free slot.
    Case("preferred-free", "cab", "c", caps="a1 b1 c1", preferred="c"),
    Case("preferred-full-next-free", "cab", "a", caps="a1 b1 c1", busy="c", preferred="c"),
    Case("preferred-all-full-waits", "cab", "wait:cab", caps="a1 b1 c1", busy="abc", preferred="c"),
    Case("preferred-tried", "cab", "a", tried="c", preferred="c"),
    Case("preferred-cooling-not-lifted", "abc", "a", cooling="b", preferred="b"),
    Case("preferred-cooling-among-cooling", "bac", "b", cooling="abc", preferred="b"),
    Case(
        "preferred-beats-least-loaded",
        "cab",
        "c",
        caps="a2 b2 c2",
        busy="c",
        balance="least-loaded",
        preferred="c",
    ),
    Case(
        "preferred-full-then-least-loaded",
        "cab",
        "b",
        caps="a2 b2 c1",
        busy="ca",
        balance="least-loaded",
        preferred="c",
    ),
]


def _expected(text: str) -> Take | Wait | Exhausted:
    if text == "none":
        return Exhausted()
    if text.startswith("wait:"):
        return Wait(tuple(text.removeprefix("wait:")))
    return Take(text)


@pytest.mark.parametrize("as_predicate", [False, True], ids=["set", "predicate"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_choose_node(case: Case, as_predicate: bool) -> None:
    ready_set = _ready(case.cooling)
    ready: Callable[[str], bool] | set[str] = ready_set.__contains__ if as_predicate else ready_set
    ledger = _ledger(case.caps, case.busy)
    choice = choose_node(
        list(case.order),
        tried=set(case.tried),
        ready=ready,
        ledger=ledger,
        balance=case.balance,
        preferred=case.preferred,
    )
    assert choice == _expected(case.expected)
    assert [ledger.in_flight(node) for node in NODES] == [case.busy.count(n) for n in NODES]


def test_each_node_is_asked_once() -> None:
    # A readiness answer that flips on every call must still leave each
    # candidate in exactly one group.
    asked: list[str] = []
    flips = itertools.cycle([True, False])

    def is_ready(node: str) -> bool:
        asked.append(node)
        return next(flips)

    choice = choose_node("abcd", tried=set(), ready=is_ready, ledger=_ledger("", ""))
    assert choice == Take("a")
    assert asked == list("abcd")


# -- the ledger -------------------------------------------------------------------------


def test_ledger_counts_and_full() -> None:
    ledger = _ledger("a2", "")
    assert ledger.nodes == tuple(NODES)
    assert (ledger.capacity("a"), ledger.capacity("b")) == (2, 0)
    first = ledger.take("a")
    assert (ledger.in_flight("a"), ledger.is_full("a"), ledger.load("a")) == (1, False, 0.5)
    ledger.take("a")
    assert ledger.is_full("a")
    with pytest.raises(NodeFull) as caught:
        ledger.take("a")
    assert caught.value.node == "a"
    assert ledger.in_flight("a") == 2
    assert ledger.release(first) is True
    assert not ledger.is_full("a")


def test_second_release_is_a_no_op() -> None:
    ledger = _ledger("a2", "a")
    slot = ledger.take("a")
    assert ledger.release(slot) is True
    assert ledger.release(slot) is False
    assert ledger.in_flight("a") == 1  # the other attempt's slot is untouched
    assert slot.released


def test_foreign_slot_and_unknown_node() -> None:
    ledger = _ledger("", "")
    with pytest.raises(ValueError, match="another ledger"):
        ledger.release(_ledger("", "").take("a"))
    with pytest.raises(KeyError):
        ledger.take("zz")


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "2"])
def test_bad_capacity(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity of 'a'"):
        SlotLedger({"a": capacity})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"balance": "random"}, "balance"), ({"max_queue": -1}, "max_queue")],
)
def test_bad_scheduler_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SlotScheduler({"a": 1}, **kwargs)  # type: ignore[arg-type]


# -- the queue --------------------------------------------------------------------------

READY_ALL = set(NODES)


def _forbidden(node: str) -> bool:
    raise AssertionError(f"readiness of {node!r} was asked")


def _granted(result: object) -> Slot:
    assert isinstance(result, Granted), result
    return result.slot


def _queued(result: object) -> Waiter[str]:
    assert isinstance(result, Queued), result
    waiter: Waiter[str] = result.waiter
    return waiter


def _handed(handoffs: list[Handoff[str]]) -> list[tuple[str, str]]:
    for handoff in handoffs:
        assert handoff.waiter.slot is handoff.slot
    return [(handoff.waiter.token, handoff.slot.node) for handoff in handoffs]


def _scheduler(caps: str, **kwargs: object) -> SlotScheduler[str]:
    return SlotScheduler(_capacities(caps), **kwargs)  # type: ignore[arg-type]


def test_three_waiters_in_arrival_order() -> None:
    s = _scheduler("a1 b1")
    on_a = _granted(s.acquire("x", "ab", ready=READY_ALL))
    on_b = _granted(s.acquire("y", "ab", ready=READY_ALL))
    waiters = [_queued(s.acquire(name, "ab", ready=READY_ALL)) for name in ("w1", "w2", "w3")]
    assert [w.position for w in waiters] == [1, 2, 3]
    assert len(s) == 3
    # Slots free at different nodes; each goes to the longest-waiting.
    assert _handed(s.release(on_b, ready=READY_ALL)) == [("w1", "b")]
    assert _handed(s.release(on_a, ready=READY_ALL)) == [("w2", "a")]
    w1_slot = waiters[0].slot
    assert w1_slot is not None
    assert _handed(s.release(w1_slot, ready=READY_ALL)) == [("w3", "b")]
    assert s.waiting() == []
    assert [s.ledger.in_flight(n) for n in "ab"] == [1, 1]


def test_waiter_that_may_not_use_the_node_is_skipped_and_keeps_its_place() -> None:
    s = _scheduler("a1 b1")
    on_a = _granted(s.acquire("x", "a", ready=READY_ALL))
    on_b = _granted(s.acquire("y", "b", ready=READY_ALL))
    only_a = _queued(s.acquire("only-a", "a", ready=READY_ALL))
    only_b = _queued(s.acquire("only-b", "b", ready=READY_ALL))
    both = _queued(s.acquire("both", "ab", ready=READY_ALL))
    assert _handed(s.release(on_b, ready=READY_ALL)) == [("only-b", "b")]
    assert s.waiting() == [only_a, both]
    assert _handed(s.release(on_a, ready=READY_ALL)) == [("only-a", "a")]
    assert only_b.slot is not None
    assert _handed(s.release(only_b.slot, ready=READY_ALL)) == [("both", "b")]


def test_waiter_that_has_tried_the_node_is_skipped() -> None:
    s = _scheduler("a1 b1")
    on_a = _granted(s.acquire("x", "ab", ready=READY_ALL))
    _granted(s.acquire("y", "ab", ready=READY_ALL))
    _queued(s.acquire("failed-on-a", "ab", tried={"a"}, ready=READY_ALL))
    _queued(s.acquire("fresh", "ab", ready=READY_ALL))
    assert _handed(s.release(on_a, ready=READY_ALL)) == [("fresh", "a")]
    assert [w.token for w in s.waiting()] == ["failed-on-a"]


def test_freed_cooling_node_skips_a_waiter_with_a_ready_candidate() -> None:
    # a cools while full; "ab" still has b ready (full): it may not use a.
    # "a" alone has no ready candidate left, so a is its to use.
    s = _scheduler("a1 b1")
    on_a = _granted(s.acquire("x", "ab", ready=READY_ALL))
    _granted(s.acquire("y", "ab", ready=READY_ALL))
    _queued(s.acquire("ab", "ab", ready=READY_ALL))
    _queued(s.acquire("only-a", "a", ready=READY_ALL))
    cooling_a = _ready("a")
    assert s.dispatch(ready=cooling_a) == []
    assert _handed(s.release(on_a, ready=cooling_a)) == [("only-a", "a")]
    assert [w.token for w in s.waiting()] == ["ab"]


@pytest.mark.parametrize("max_queue", [1, 2, 3])
def test_admission_at_max_queue(max_queue: int) -> None:
    s = _scheduler("a1", max_queue=max_queue)
    on_a = _granted(s.acquire("x", "a", ready=READY_ALL))
    waiters = [_queued(s.acquire(f"w{i}", "a", ready=READY_ALL)) for i in range(max_queue)]
    assert isinstance(s.acquire("late", "a", ready=READY_ALL), QueueFull)
    assert len(s) == max_queue
    # A workload that need not wait is never turned away by a full queue.
    assert isinstance(s.acquire("elsewhere", "b", ready=READY_ALL), Granted)
    assert isinstance(s.acquire("nothing-left", "a", tried={"a"}, ready=READY_ALL), Exhausted)
    # Once one is served, there is room for one more, at the back.
    assert _handed(s.release(on_a, ready=READY_ALL)) == [("w0", "a")]
    again = _queued(s.acquire("again", "a", ready=READY_ALL))
    assert again.position == max_queue
    assert s.waiting() == [*waiters[1:], again]


def test_no_limit_on_the_queue() -> None:
    s = _scheduler("a1", max_queue=0)
    _granted(s.acquire("x", "a", ready=READY_ALL))
    positions = [_queued(s.acquire(f"w{i}", "a", ready=READY_ALL)).position for i in range(50)]
    assert positions == list(range(1, 51))


@pytest.mark.parametrize("fair", [True, False])
def test_a_waiters_place_is_its_turn_in_the_order_slots_go(fair: bool) -> None:
    # Fair: a higher priority first, then a client running nothing, then
    # the client's own earlier waiters; not fair: arrival order.
    s = _scheduler("a1", fair=fair)
    x = _granted(s.acquire("x", "a", ready=READY_ALL, client="A"))  # A runs
    places = {}
    for token, client, rank in [
        ("a1", "A", 1),
        ("a2", "A", 1),
        ("b1", "B", 1),  # B runs nothing: before A's
        ("a3", "A", 1),
        ("h1", "A", 0),  # high priority: before all
        ("l1", "C", 2),  # low priority: after all
        ("b2", "B", 1),
    ]:
        places[token] = _queued(s.acquire(token, "a", ready=READY_ALL, client=client, rank=rank))
    expected = {
        True: {"a1": 1, "a2": 2, "b1": 1, "a3": 4, "h1": 1, "l1": 6, "b2": 3},
        False: {"a1": 1, "a2": 2, "b1": 3, "a3": 4, "h1": 5, "l1": 6, "b2": 7},
    }[fair]
    assert {token: waiter.position for token, waiter in places.items()} == expected
    # The one that said 1 last (of the fair order, h1) is the next served.
    assert _handed(s.release(x, ready=READY_ALL)) == [("h1" if fair else "a1", "a")]


def test_waiter_removed_mid_queue() -> None:
    s = _scheduler("a1")
    on_a = _granted(s.acquire("x", "a", ready=READY_ALL))
    w1, w2, w3 = (_queued(s.acquire(name, "a", ready=READY_ALL)) for name in ("w1", "w2", "w3"))
    assert s.leave(w2, ready=_forbidden) == []
    assert s.leave(w2, ready=_forbidden) == []  # twice: no-op
    assert s.waiting() == [w1, w3]
    assert _queued(s.acquire("w4", "a", ready=READY_ALL)).position == 3
    assert _handed(s.release(on_a, ready=READY_ALL)) == [("w1", "a")]
    assert w1.slot is not None
    assert _handed(s.release(w1.slot, ready=READY_ALL)) == [("w3", "a")]
    assert w2.slot is None


def test_handed_slot_left_unused_goes_to_the_next() -> None:
    # The waiter's timeout (or its client's leaving) races its hand-off.
    s = _scheduler("a1")
    on_a = _granted(s.acquire("x", "a", ready=READY_ALL))
    w1 = _queued(s.acquire("w1", "a", ready=READY_ALL))
    _queued(s.acquire("w2", "a", ready=READY_ALL))
    assert _handed(s.release(on_a, ready=READY_ALL)) == [("w1", "a")]
    assert _handed(s.leave(w1, ready=READY_ALL)) == [("w2", "a")]
    assert s.leave(w1, ready=_forbidden) == []
    assert s.ledger.in_flight("a") == 1


@pytest.mark.parametrize(
    ("change", "ready_after", "expected"),
    [
        # a cools: b is still ready, so the wait goes on, for b only.
        ("a-cools", "b", []),
        # a and b cool: no ready candidate left, the free cooling c is used.
        ("a-b-cool", "", [("w1", "c"), ("w2", "d")]),
        # c recovers: a free ready node it could not use before.
        ("c-recovers", "abc", [("w1", "c")]),
        ("nothing-changes", "ab", []),
    ],
)
def test_node_changes_state_while_workloads_wait(
    change: str, ready_after: str, expected: list[tuple[str, str]]
) -> None:
    s = _scheduler("a1 b1 c1 d1")
    before = set("ab")
    _granted(s.acquire("x", "abcd", ready=before))
    _granted(s.acquire("y", "abcd", ready=before))
    _queued(s.acquire("w1", "abcd", ready=before))
    _queued(s.acquire("w2", "abcd", ready=before))
    assert _handed(s.dispatch(ready=set(ready_after))) == expected, change
    assert len(s) == 2 - len(expected)


def test_failover_into_a_full_fleet_waits_again() -> None:
    s = _scheduler("a1 b1")
    x = _granted(s.acquire("x", "ab", ready=READY_ALL))
    y = _granted(s.acquire("y", "ab", ready=READY_ALL))
    _queued(s.acquire("w", "ab", ready=READY_ALL))
    # x fails at a: its slot goes to the waiter, x itself must wait for b.
    assert _handed(s.release(x, ready=READY_ALL)) == [("w", "a")]
    x_again = _queued(s.acquire("x", "ab", tried={"a"}, ready=READY_ALL))
    assert x_again.position == 1
    assert _handed(s.release(y, ready=READY_ALL)) == [("x", "b")]


def test_hot_path_never_looks_at_the_queue() -> None:
    # Empty queue: release asks nothing. A node that was not full (or has no
    # limit) frees nothing a waiter waits for, even with a waiter that lists
    # it: nobody is asked about, nobody is handed anything.
    s = _scheduler("a1 b2")
    slot = _granted(s.acquire("x", "a", ready=READY_ALL))
    assert s.release(slot, ready=_forbidden) == []
    assert s.dispatch(ready=_forbidden) == []
    only_a = {"a"}
    _granted(s.acquire("x", "abc", ready=only_a))
    _queued(s.acquire("w", "abc", ready=only_a))  # b and c cool: it waits for a
    on_b = _granted(s.acquire("y", "b", ready=only_a))
    on_c = _granted(s.acquire("z", "c", ready=only_a))
    assert s.release(on_b, ready=_forbidden) == []
    assert s.release(on_c, ready=_forbidden) == []
    assert s.release(on_c, ready=_forbidden) == []  # twice
    assert len(s) == 1


def test_one_dispatch_asks_about_each_node_once() -> None:
    # Many waiters, one decision: a readiness read at "now" must give every
    # waiter the same answer, so it is asked once per node and remembered.
    s = _scheduler("a1 b1")
    _granted(s.acquire("x", "ab", ready=READY_ALL))
    _granted(s.acquire("y", "ab", ready=READY_ALL))
    for name in ("w1", "w2", "w3"):
        _queued(s.acquire(name, "ab", ready=READY_ALL))
    asked: list[str] = []

    def is_ready(node: str) -> bool:
        asked.append(node)
        return True

    assert s.dispatch(ready=is_ready) == []
    assert sorted(asked) == ["a", "b"]


def test_drain_empties_the_queue() -> None:
    s = _scheduler("a1")
    on_a = _granted(s.acquire("x", "a", ready=READY_ALL))
    waiters = [_queued(s.acquire(name, "a", ready=READY_ALL)) for name in ("w1", "w2")]
    assert s.drain() == waiters
    assert len(s) == 0
    assert s.release(on_a, ready=_forbidden) == []
    assert all(w.slot is None for w in waiters)


@pytest.mark.parametrize(("balance", "nodes"), [("priority", "aabb"), ("least-loaded", "abab")])
def test_scheduler_applies_its_balance_mode(balance: Balance, nodes: str) -> None:
    s = _scheduler("a2 b2", balance=balance)
    slots = [_granted(s.acquire(f"w{i}", "ab", ready=READY_ALL)) for i in range(4)]
    assert "".join(slot.node for slot in slots) == nodes
    assert isinstance(s.acquire("w5", "ab", ready=READY_ALL), Queued)


def test_capacity_zero_everywhere_never_queues() -> None:
    s = _scheduler("")
    for index in range(100):
        slot = _granted(s.acquire(f"w{index}", "abcd", ready=READY_ALL))
        assert slot.node == "a"
    assert s.ledger.in_flight("a") == 100


# -- the queue-timeout budget -----------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "waited", "now", "remaining", "deadline"),
    [
        (120.0, 0.0, 10.0, 120.0, 130.0),
        (120.0, 45.5, 100.0, 74.5, 174.5),
        (120.0, 120.0, 100.0, 0.0, 100.0),
        (120.0, 130.0, 100.0, 0.0, 100.0),  # never a deadline in the past
        (0.0, 0.0, 5.0, math.inf, math.inf),  # no limit
        (0.0, 999.0, 5.0, math.inf, math.inf),
    ],
)
def test_budget_remaining_and_deadline(
    timeout: float, waited: float, now: float, remaining: float, deadline: float
) -> None:
    budget = QueueBudget(timeout, waited)
    assert budget.remaining() == remaining
    assert budget.deadline(now) == deadline


def test_budget_across_two_waits() -> None:
    budget = QueueBudget(120.0)
    budget = budget.spent(10.0, 40.0)  # first wait: 30 s, then a failed attempt
    assert budget.waited == 30.0
    assert budget.deadline(100.0) == 190.0  # the second wait gets the rest
    budget = budget.spent(100.0, 190.0)
    assert (budget.waited, budget.remaining()) == (120.0, 0.0)
    assert QueueBudget(1.0).spent(5.0, 4.0).waited == 0.0


@pytest.mark.parametrize(("timeout", "waited"), [(-1.0, 0.0), (1.0, -0.5), (math.nan, 0.0)])
def test_budget_rejects_bad_numbers(timeout: float, waited: float) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        QueueBudget(timeout, waited)


# -- properties under random sequences ---------------------------------------------------

# Acquires weighted up and few nodes tried, so that queues form and hand-offs happen.
ACQUIRE = st.tuples(
    st.just("acquire"), st.permutations("abc"), st.sets(st.sampled_from("abc"), max_size=1)
)
OPS = st.lists(
    st.one_of(
        ACQUIRE,
        ACQUIRE,
        ACQUIRE,
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("leave"), st.integers(0, 30)),
        st.tuples(st.just("state"), st.sets(st.sampled_from("abc"))),
        st.tuples(st.just("release-again"), st.integers(0, 30)),
    ),
    min_size=8,
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(
    caps=st.tuples(*[st.sampled_from([0, 1, 1, 1, 2])] * 3),
    balance=st.sampled_from(["priority", "least-loaded"]),
    max_queue=st.integers(0, 4),
    ops=OPS,
)
def test_ledger_and_queue_invariants(
    caps: tuple[int, int, int], balance: Balance, max_queue: int, ops: list[tuple[object, ...]]
) -> None:
    s: SlotScheduler[int] = SlotScheduler(
        dict(zip("abc", caps, strict=True)), balance=balance, max_queue=max_queue
    )
    ready: set[str] = set("abc")
    held: list[Slot] = []
    released: list[Slot] = []
    waiters: list[Waiter[int]] = []
    handed: set[Waiter[int]] = set()  # the objects: an id() could be reused

    def took(handoffs: list[Handoff[int]]) -> None:
        for handoff in handoffs:
            assert handoff.waiter not in handed  # handed at most once
            handed.add(handoff.waiter)
            held.append(handoff.slot)

    for index, op in enumerate(ops):
        match op:
            case ("acquire", order, tried):
                result = s.acquire(index, order, tried=tried, ready=ready)  # type: ignore[arg-type]
                if isinstance(result, Granted):
                    held.append(result.slot)
                elif isinstance(result, Queued):
                    waiters.append(result.waiter)
            case ("release", pick) if held:
                slot = held.pop(pick % len(held))  # type: ignore[operator]
                released.append(slot)
                took(s.release(slot, ready=ready))
            case ("release-again", pick) if released:
                took(s.release(released[pick % len(released)], ready=ready))  # type: ignore[operator]
            case ("leave", pick) if waiters:
                waiter = waiters.pop(pick % len(waiters))  # type: ignore[operator]
                if waiter.slot is not None and waiter.slot in held:
                    held.remove(waiter.slot)
                    released.append(waiter.slot)
                took(s.leave(waiter, ready=ready))
            case ("state", now_ready):
                ready = now_ready  # type: ignore[assignment]
                took(s.dispatch(ready=ready))
        for node, capacity in zip("abc", caps, strict=True):
            in_flight = s.ledger.in_flight(node)
            assert in_flight >= 0
            assert capacity == 0 or in_flight <= capacity
            assert in_flight == sum(1 for slot in held if slot.node == node)
        assert max_queue == 0 or len(s) <= max_queue
        # Rule 2: no waiter is left waiting while something it may use is free.
        for waiter in s.waiting():
            assert waiter.slot is None
            choice = choose_node(
                waiter.order,
                tried=waiter.tried,
                ready=ready,
                ledger=s.ledger,
                balance=balance,
                preferred=waiter.preferred,
            )
            assert isinstance(choice, Wait), (waiter, choice)


# -- layering ------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["slots", "sharing"])
def test_module_imports_only_the_standard_library(module: str) -> None:
    # Stricter than test_layering's rule: the shell author builds on this
    # module as it is, so it must not reach into the package either; the
    # one exception is the clients' shares (``sharing.py``), held to the
    # same rule.
    path = Path(__file__).resolve().parent.parent / "trio_failover" / "core" / f"{module}.py"
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            tops.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and module == "slots" and node.module == "sharing":
                continue
            assert not node.level, node.module
            tops.add((node.module or "").partition(".")[0])
    assert tops
    assert tops <= set(sys.stdlib_module_names) - {"time", "socket", "asyncio", "threading"}


@dataclass(frozen=True)
class _Reading:
    """An engine's reading (``EngineLoad``)."""

    busy: int | None
    waiting: int | None = None


@pytest.mark.parametrize(
    ("ours", "busy", "ended", "expected", "moved"),
    [
        (0, 1, 1, 0, 1),  # another replica's one attempt ended: free now
        (0, 2, 1, 1, 1),  # two of others, one ended
        (1, 2, 1, 1, 1),  # ours stays counted
        (1, 1, 1, 1, 0),  # the reading holds no others: left alone
        (0, 1, 3, 0, 1),  # more ended than the reading held: never below our count
        (0, None, 1, None, 0),  # the engine says nothing: nothing to move
    ],
)
def test_an_attempt_ended_elsewhere_comes_off_the_engines_reading(
    ours: int, busy: int | None, ended: int, expected: int | None, moved: int
) -> None:
    signals = {"a": _Reading(busy)}
    ledger = SlotLedger({"a": 3}, signals)
    for _ in range(ours):
        ledger.take("a")
    ledger.note_reading("a")
    assert sum(ledger.ended_elsewhere("a") for _ in range(ended)) == moved
    assert ledger.engine_busy("a") == expected
    assert ledger.ended_elsewhere("b") is False  # a node without a reading: nothing happens


def test_an_attempt_ended_elsewhere_counts_until_the_next_reading_only() -> None:
    signals = {"a": _Reading(1)}
    ledger = SlotLedger({"a": 1}, signals)
    ledger.note_reading("a")
    ledger.ended_elsewhere("a")
    assert not ledger.is_full("a")
    ledger.note_reading("a")  # a fresh reading that still says busy 1: full again
    assert ledger.is_full("a")


@pytest.mark.parametrize(
    ("capacity", "ours", "busy", "crowded"),
    [
        (1, 1, 1, False),  # the engine's one busy slot is ours
        (1, 0, 1, True),  # another's: a waiter here asks Redis nothing
        (2, 1, 2, True),  # ours and one of another's fill it
        (2, 0, 1, False),  # room by the engine's count
        (2, 2, 2, False),  # full, but by our own count only
        (1, 0, None, False),  # the engine says nothing
        (0, 0, 5, False),  # no capacity: never full
    ],
)
def test_a_node_full_by_others_work_is_told_from_one_full_by_ours(
    capacity: int, ours: int, busy: int | None, crowded: bool
) -> None:
    signals: dict[str, _Reading] = {}
    ledger = SlotLedger({"a": capacity}, signals)
    for _ in range(ours):
        ledger.take("a")
    signals["a"] = _Reading(busy)
    ledger.note_reading("a")  # read while our attempts ran: they are among its busy
    assert ledger.full_by_others("a") is crowded
