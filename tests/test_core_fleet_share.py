"""core/fleet_share.py: fleet-wide standing and whether a freed slot waits for another replica."""

from __future__ import annotations

import functools
import math
import random

import pytest

from trio_failover.core.fleet_share import (
    ClientShare,
    ShareSummary,
    Standing,
    defer_to_fleet,
    fleet_standing,
    told_by_replicas,
)
from trio_failover.core.sharing import HALF_LIFE, ShareBook
from trio_failover.core.slots import Granted, Queued, Slot, SlotScheduler, Waiter


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


def running_elsewhere(s: SlotScheduler[str], counts: dict[str, int], now: float = 0.0) -> bool:
    """The other replicas run ``counts`` (of no use yet), heard at ``now``."""
    return s.told_elsewhere([(now, client, n, 0.0) for client, n in counts.items()], now)


def test_attempts_elsewhere_count_toward_max_in_flight() -> None:
    s: SlotScheduler[str] = SlotScheduler({"n": 2})
    s.configure_clients({"one": (1.0, 1)})
    assert running_elsewhere(s, {"one": 1, "free": 3}) is False
    assert s.shares.clients["free"].elsewhere == 3  # no limit, but not idle either
    queued = s.acquire("w", "n", ready=set("n"), client="one")
    assert isinstance(queued, Queued)  # the node has room, the client has not
    assert running_elsewhere(s, {"one": 1, "free": 2}) is False  # free has no limit to lift
    assert running_elsewhere(s, {}) is True  # it ended there
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
    running_elsewhere(s, {"one": 1})
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
    running_elsewhere(s, {"one": 1})
    assert s.release(on_n.slot, ready=set("nm")) == []


# -- fleet-wide use in this replica's own order ----------------------------------------

C = HALF_LIFE / math.log(2)


def test_told_by_replicas_names_a_client_once_per_replica_with_when_it_came() -> None:
    one = summary(
        ClientShare("a", 1, 2, 1, 3.0),
        ClientShare("a", 2, 1, 1, 3.0),
        ClientShare("b", 1, 0, 2, 5.0),
    )
    two = summary(ClientShare("a", 1, 0, 0, 1.0))
    assert told_by_replicas([(one, 4.0), (two, 5.0)]) == [
        (4.0, "a", 1, 3.0),
        (4.0, "b", 2, 5.0),
        (5.0, "a", 0, 1.0),
    ]


def held(start: float, end: float, now: float) -> float:
    """The use at ``now`` of one slot held from ``start`` to ``end``."""
    return C * (2 ** ((end - now) / HALF_LIFE) - 2 ** ((start - now) / HALF_LIFE))


# (what the other replicas told: (heard at, client, running there, use there),
#  a's own slots here: (took, released or None: running), now, a's fleet-wide use)
FLEET_USE_CASES = [
    # Nothing told: its own use alone.
    ([], [(0.0, 10.0)], 60.0, held(0.0, 10.0, 60.0)),
    # 10 told at 0, nothing running there: halved a minute later.
    ([(0.0, "a", 0, 10.0)], [], 60.0, 5.0),
    # Two running there: plus what they earned since, as one running here would.
    ([(0.0, "a", 2, 10.0)], [], 60.0, 5.0 + 2 * held(0.0, 60.0, 60.0)),
    # Two replicas and its own add up, each counted once (the told use holds
    # the running ones' until then; its own running one counts here alone).
    (
        [(0.0, "a", 0, 10.0), (30.0, "a", 1, 4.0), (30.0, "b", 3, 99.0)],
        [(0.0, None)],
        60.0,
        5.0 + 4.0 * 2**-0.5 + held(30.0, 60.0, 60.0) + held(0.0, 60.0, 60.0),
    ),
    # Told before the book's first sight (heard at 5, the epoch is 6).
    ([(5.0, "a", 0, 8.0)], [(6.0, 7.0)], 66.0, 8.0 * 2 ** (-61 / 60) + held(6.0, 7.0, 66.0)),
]


@pytest.mark.parametrize(("told", "own", "now", "expected"), FLEET_USE_CASES)
def test_a_clients_use_is_its_own_plus_the_other_replicas(
    told: list[tuple[float, str, int, float]],
    own: list[tuple[float, float | None]],
    now: float,
    expected: float,
) -> None:
    book = ShareBook()
    for start, end in own:
        book.took("a", start)
        if end is not None:
            book.released("a", end)
    book.told_elsewhere(told, now)
    assert book.fleet_use("a", now) == pytest.approx(expected, rel=1e-9)
    # What this replica tells the others is its own use alone: no double count.
    mine = sum(held(start, now if end is None else end, now) for start, end in own)
    assert book.use("a", now) == pytest.approx(mine, rel=1e-9, abs=1e-12)


def test_the_figures_told_again_change_nothing_and_survive_a_move_of_the_epoch() -> None:
    book = ShareBook({"lim": (1.0, 2)})
    told = [(3.0, "a", 1, 2.5), (3.0, "lim", 2, 0.0)]
    assert book.told_elsewhere(told, 3.5) == ({"a", "lim"}, False)
    assert book.told_elsewhere(told, 3.6) == (set(), False)  # the same sums, to the bit
    assert book.told_elsewhere(told[:1], 3.7) == ({"lim"}, True)  # lim's count fell
    # Past half an hour the epoch moves (every sum scaled once): the same use.
    expected = 2.5 * 2 ** ((3.0 - 1810.0) / HALF_LIFE) + held(3.0, 1810.0, 1810.0)
    assert book.epoch == 3.5
    assert book.fleet_use("a", 1810.0) == pytest.approx(expected, rel=1e-9)
    assert book.epoch == 1810.0
    assert book.told_elsewhere(told[:1], 1810.0).fell is False  # the same, at the new epoch
    assert book.fleet_use("a", 1810.0) == pytest.approx(expected, rel=1e-9)
    assert book.told_elsewhere([], 1811.0) == ({"a"}, False)  # a has no limit to lift
    book.forget(1811.0, set())
    assert book.clients == {}  # nothing told, nothing used: forgotten


T = 100.0
# (each client's own slot-seconds here, ended at 10 s, and its attempts
#  running here since T - 10; what the other replicas told at T - 1:
#  (client, running there, use there); whose waiter takes the freed slot
#  at T, a's and b's waiting, a's first)
ORDER_CASES = [
    # Nothing told: a used less here.
    ({"a": (10.0, 0), "b": (20.0, 0)}, [], "a"),
    # One client floods through two replicas, the other through this one:
    # fleet-wide a used far more.
    ({"a": (10.0, 0), "b": (20.0, 0)}, [("a", 0, 100.0)], "b"),
    # Two replicas add up: 10 + 6 + 6 is more than 20.
    ({"a": (10.0, 0), "b": (20.0, 0)}, [("a", 0, 6.0), ("a", 0, 6.0)], "b"),
    # a runs nothing here but three elsewhere: not idle, and it used more.
    ({"a": (0.0, 0), "b": (10.0, 1)}, [("a", 3, 60.0)], "b"),
    # Running both, fleet-wide: the lower use goes first.
    ({"a": (0.0, 0), "b": (10.0, 1)}, [("a", 3, 1.0)], "a"),
    # Idle fleet-wide still goes before running; others' figures change nothing.
    ({"a": (30.0, 0), "b": (10.0, 1)}, [("c", 2, 50.0), ("b", 0, 0.0)], "a"),
    ({"a": (30.0, 0), "b": (10.0, 0)}, [("b", 1, 0.0)], "a"),
]


@pytest.mark.parametrize(("own", "told", "first"), ORDER_CASES)
def test_this_replicas_queue_is_ordered_by_fleet_wide_use(
    own: dict[str, tuple[float, int]], told: list[tuple[str, int, float]], first: str
) -> None:
    s: SlotScheduler[str] = SlotScheduler({"n": 1, "u": 0})
    for client, (used, running) in own.items():
        if used:
            s.shares.took(client, 0.0)
            s.shares.released(client, used)
        for i in range(running):
            runs = s.acquire(f"{client}-run{i}", "u", ready=set("nu"), client=client, now=T - 10)
            assert isinstance(runs, Granted)
    blocker = s.acquire("x", "n", ready=set("nu"), client="x", now=0.0)
    assert isinstance(blocker, Granted)
    for client in ("a", "b"):
        assert isinstance(s.acquire(client, "n", ready=set("nu"), client=client, now=T - 1), Queued)
    s.told_elsewhere([(T - 1, client, running, use) for client, running, use in told], T - 1)
    [handoff] = s.release(blocker.slot, ready=set("nu"), now=T)
    assert handoff.waiter.token == first


def test_the_idle_order_follows_the_figures_as_they_change() -> None:
    """The idle clients' heap: a key that changes, a client busy elsewhere, idle again."""
    s: SlotScheduler[str] = SlotScheduler({"n": 4})
    blockers = []
    for client in "wxyz":
        taken = s.acquire(client, "n", ready={"n"}, client=client, now=0.0)
        assert isinstance(taken, Granted)
        blockers.append(taken.slot)
    for client, used in (("a", 10.0), ("c", 30.0), ("d", 50.0), ("e", 55.0)):
        s.shares.took(client, 0.0)
        s.shares.released(client, used)
    for token in ("a1", "a2", "c1", "d1", "e1"):
        assert isinstance(s.acquire(token, "n", ready={"n"}, client=token[0], now=60.0), Queued)

    def told(*figures: tuple[int, float]) -> None:
        s.told_elsewhere([(60.0, "a", running, use) for running, use in figures], 60.0)

    def next_served() -> str:
        [handoff] = s.release(blockers.pop(), ready={"n"}, now=60.0)
        return handoff.waiter.token

    told((0, 100.0))  # idle still, at a higher key: c (30) before a (110)
    assert next_served() == "c1"
    told((2, 0.0))  # busy elsewhere: d, idle, before a and c, which run
    assert next_served() == "d1"
    told()  # idle again, at its own 10: first again (e, idle at 55, next)
    assert next_served() == "a1"
    assert s.share_summary(60.0)[0][:4] == ("a", 1, 1, 1)  # its own running, not the others'


def the_rule(
    s: SlotScheduler[int], now: float, taker: str | None, waiter: Waiter[int]
) -> tuple[int, bool, float, int]:
    """Smaller goes first; the figures before the hand-off that gave ``taker`` a slot.

    A take at ``now`` has used nothing yet: it only counts running.
    """
    use = s.shares.clients[waiter.client]
    running = use.running - (waiter.client == taker) + use.elsewhere
    fleet = s.shares.fleet_use(waiter.client, now) / use.weight
    return (waiter.rank, running > 0, fleet, waiter.seq)


@pytest.mark.parametrize("seed", range(20))
def test_every_hand_off_is_the_fleet_wide_fairest_waiter(seed: int) -> None:
    """Random takes, waits, releases and figures told: each freed slot goes as the rule says.

    The rule, computed plainly over every waiter that may use the freed
    node: the highest priority, then nothing running fleet-wide, then the
    lowest fleet-wide use ÷ weight, then the longest-waiting. Each client
    starts with a use of its own (no two equal: no ties between clients).
    """
    rng = random.Random(seed)
    nodes = "nmo"
    s: SlotScheduler[int] = SlotScheduler({node: rng.choice((1, 2)) for node in nodes})
    clients = [f"c{i}" for i in range(8)]
    s.configure_clients({client: (rng.choice((1.0, 2.0, 0.5)), 0) for client in clients[:4]})
    for client in clients:
        s.shares.took(client, 0.0)
        s.shares.released(client, rng.uniform(0.1, 30.0))
    ready = set(nodes)
    running: list[Slot] = []
    now = 30.0
    handed = 0
    for token in range(400):
        now += rng.uniform(0.0, 2.0)
        step = rng.random()
        if step < 0.45:
            order = rng.sample(nodes, rng.randint(1, 3))
            client, rank = rng.choice(clients), rng.choice((0, 1, 1, 2))
            result = s.acquire(token, order, ready=ready, client=client, rank=rank, now=now)
            if isinstance(result, Granted):
                running.append(result.slot)
        elif step < 0.8 and running:
            slot = running.pop(rng.randrange(len(running)))
            was_full = s.ledger.is_full(slot.node)
            can = [w for w in s.waiting() if slot.node in w.untried]
            handoffs = s.release(slot, ready=ready, now=now)
            if not (was_full and can):
                assert handoffs == []
                continue

            taker = handoffs[0].waiter.client if handoffs else None
            expected = min(can, key=functools.partial(the_rule, s, now, taker))
            assert [h.waiter for h in handoffs] == [expected]
            running.append(handoffs[0].slot)
            handed += 1
        else:
            told = [
                (now - rng.uniform(0.0, 1.0), client, rng.choice((0, 0, 1, 3)), rng.uniform(0, 90))
                for client in rng.sample(clients, rng.randint(0, 4))
            ]
            s.told_elsewhere(told, now)
    assert handed > 20
