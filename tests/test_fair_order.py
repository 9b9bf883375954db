"""The fair hand-off against a plain reference, under random sequences.

The scheduler keeps the idle clients in a heap and takes shortcuts so that a
hand-off never scans every waiter (docs/performance.md, "The slot
scheduler's hand-off"). Here a slow and obvious reference decides the same
hand-offs from the scheduler's public figures: of the highest priority with
a waiter that may take the freed slot, the client with nothing running
(here or at the other replicas) before any with something running, then the
lowest use ÷ weight (use as ``ShareBook.fleet_use`` says, running attempts
and the other replicas' figures included), not at its ``max_in_flight``,
then that client's longest-waiting that may take it. Clients whose figures
are equal to the last bits may go in either order: the reference accepts
any of them.
"""

from __future__ import annotations

import copy
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from trio_failover.core.sharing import ClientUse
from trio_failover.core.slots import (
    Granted,
    Handoff,
    Queued,
    Slot,
    SlotScheduler,
    Take,
    Waiter,
    _Lane,
    choose_node,
)

CLIENTS = "pqrstu"
NODES = ("a", "b")
READY = frozenset(NODES)


def first_taker(
    s: SlotScheduler[int], waiters: list[Waiter[int]], freed: str
) -> Waiter[int] | None:
    """The longest-waiting of ``waiters`` that may take a slot now (``freed`` among its untried)."""
    for waiter in waiters:
        if freed not in waiter.untried:
            continue
        choice = choose_node(
            waiter.order,
            tried=waiter.tried,
            ready=READY,
            ledger=s.ledger,
            balance=s.balance,
            preferred=waiter.preferred,
            loaded=waiter.loaded,
        )
        if isinstance(choice, Take):
            return waiter
    return None


def acceptable(s: SlotScheduler[int], freed: str, now: float) -> set[int]:
    """The tokens of the waiters that may rightly take the slot freed at ``now``.

    ``s`` is the scheduler just after the release, before its hand-off.
    """
    shares = s.shares
    for rank in range(3):
        by_client: dict[str, list[Waiter[int]]] = {}
        for waiter in s.waiting():
            if waiter.rank == rank:
                by_client.setdefault(waiter.client, []).append(waiter)
        ranked: list[tuple[bool, float, int]] = []
        for client, waiters in by_client.items():
            if shares.at_limit(client):
                continue
            taker = first_taker(s, waiters, freed)
            if taker is None:
                continue
            use = shares.client(client)
            busy = bool(use.running + use.elsewhere)
            ranked.append((busy, shares.fleet_use(client, now) / use.weight, taker.token))
        if ranked:
            busy, best, _ = min(ranked)
            near = best + 1e-9 * max(abs(best), 1.0)
            return {token for b, key, token in ranked if b == busy and key <= near}
    return set()


def place_range(s: SlotScheduler[int], newcomer: Waiter[int], now: float) -> tuple[int, int]:
    """The places ``newcomer``, just queued, may rightly report: (first, last), 1 = next.

    Behind every waiter of a higher priority and its own client's earlier
    ones, and those of the clients of its priority that go before its client
    by the order of ``acceptable``; a client whose figures equal its client's
    may go either side.
    """
    shares = s.shares

    def standing(client: str) -> tuple[bool, float]:
        use = shares.client(client)
        return bool(use.running + use.elsewhere), shares.fleet_use(client, now) / use.weight

    busy, mine = standing(newcomer.client)
    near = 1e-9 * max(abs(mine), 1.0)
    before = tied = 0
    for waiter in s.waiting():
        if waiter is newcomer or waiter.rank > newcomer.rank:
            continue
        if waiter.rank < newcomer.rank or waiter.client == newcomer.client:
            before += 1
            continue
        their_busy, theirs = standing(waiter.client)
        if their_busy != busy:
            before += their_busy < busy
        elif abs(theirs - mine) <= near:
            tied += 1
        elif theirs < mine:
            before += 1
    return 1 + before, 1 + before + tied


OPS = st.lists(
    st.one_of(
        # acquire: client, rank, order (b only, a only or either), time step
        st.tuples(
            st.just("acquire"),
            st.sampled_from(CLIENTS),
            st.sampled_from([0, 1, 1, 1, 2]),
            st.sampled_from([("a", "b"), ("b",), ("a",), ("b", "a")]),
        ),
        st.tuples(st.just("acquire"), st.sampled_from(CLIENTS), st.just(1), st.just(("a", "b"))),
        st.tuples(st.just("acquire"), st.sampled_from(CLIENTS), st.just(1), st.just(("a", "b"))),
        st.tuples(st.just("acquire"), st.sampled_from(CLIENTS), st.just(1), st.just(("b",))),
        st.tuples(st.just("release"), st.integers(0, 30), st.floats(0.0, 40.0)),
        st.tuples(st.just("release"), st.integers(0, 30), st.floats(0.0, 40.0)),
        st.tuples(st.just("leave"), st.integers(0, 30)),
        # what the other replicas tell: per client, running there and use
        st.tuples(
            st.just("elsewhere"),
            st.lists(
                st.tuples(st.sampled_from(CLIENTS), st.integers(0, 2), st.floats(0.0, 60.0)),
                max_size=3,
            ),
        ),
        st.tuples(st.just("weights"), st.sampled_from(CLIENTS), st.sampled_from([0.5, 1.0, 3.0])),
        st.tuples(st.just("later"), st.sampled_from([0.0, 1.0, 1800.5])),
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    caps=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    limits=st.dictionaries(st.sampled_from(CLIENTS), st.integers(0, 2), max_size=3),
    ops=OPS,
)
def test_each_hand_off_and_place_is_what_a_plain_scan_would_choose(
    caps: tuple[int, int], limits: dict[str, int], ops: list[tuple[object, ...]]
) -> None:
    s: SlotScheduler[int] = SlotScheduler(dict(zip(NODES, caps, strict=True)))
    settings_ = {client: (1.0, limit) for client, limit in limits.items()}
    s.configure_clients(settings_)
    now = 0.0
    held: list[Slot] = []
    waiters: list[Waiter[int]] = []

    def took(handoffs: list[Handoff[int]]) -> None:
        for handoff in handoffs:
            held.append(handoff.slot)

    for index, op in enumerate(ops):
        match op:
            case ("acquire", client, rank, order):
                result = s.acquire(index, order, ready=READY, client=client, rank=rank, now=now)  # type: ignore[arg-type]
                if isinstance(result, Granted):
                    held.append(result.slot)
                elif isinstance(result, Queued):
                    waiters.append(result.waiter)
                    first, last = place_range(s, result.waiter, now)
                    assert first <= result.waiter.position <= last, (first, last)
            case ("release", pick, step) if held:
                now += step  # type: ignore[operator]
                slot = held.pop(pick % len(held))  # type: ignore[operator]
                assert slot.client is not None
                limited = s.shares.at_limit(slot.client)
                was_full = s.ledger.is_full(slot.node)
                # The reference decides on a copy, released by hand.
                copied, copied_slot = copy.deepcopy((s, slot))
                copied.ledger.release(copied_slot)
                copied.shares.released(slot.client, now)
                expected = acceptable(copied, slot.node, now) if was_full else set()
                handoffs = s.release(slot, ready=READY, now=now)
                if not limited:
                    if expected:
                        assert handoffs, expected
                        assert handoffs[0].waiter.token in expected, (handoffs, expected)
                    else:
                        assert not handoffs
                took(handoffs)
            case ("leave", pick) if waiters:
                waiter = waiters.pop(pick % len(waiters))  # type: ignore[operator]
                if waiter.slot is not None and waiter.slot in held:
                    held.remove(waiter.slot)
                took(s.leave(waiter, ready=READY, now=now))
            case ("elsewhere", told):
                figures = [(now, client, running, use) for client, running, use in told]  # type: ignore[attr-defined]
                if s.told_elsewhere(figures, now):
                    took(s.dispatch(ready=READY, now=now))
            case ("weights", client, weight):
                settings_[client] = (weight, settings_.get(client, (1.0, 0))[1])  # type: ignore[index]
                s.configure_clients(settings_)
            case ("later", step):
                now += step  # type: ignore[operator]
        waiters = [waiter for waiter in waiters if waiter.slot is None and not waiter.displaced]


def test_a_client_told_of_use_elsewhere_while_running_goes_by_its_fleet_use_once_idle() -> None:
    # The release that leaves a client idle puts its lanes in the idle order
    # by its fleet-wide use: the other replicas' share of it counts too.
    s: SlotScheduler[str] = SlotScheduler({"a": 2})
    s.shares.took("w", 0.0)
    s.shares.released("w", 100.0)  # w: about 100 slot-seconds here
    s.configure_clients({})  # as at start: the idle order is made afresh
    x = s.acquire("x0", ["a"], ready=READY, client="x", now=100.0)
    z = s.acquire("z0", ["a"], ready=READY, client="z", now=100.0)
    assert isinstance(x, Granted)
    assert isinstance(z, Granted)
    for token, client in (("w1", "w"), ("x1", "x")):
        assert isinstance(s.acquire(token, ["a"], ready=READY, client=client, now=100.0), Queued)
    # While x runs here, the other replicas tell of 5 slot-seconds of x's.
    s.told_elsewhere([(100.0, "x", 0, 5.0)], 100.0)
    [handoff] = s.release(x.slot, ready=READY, now=101.0)
    assert handoff.waiter.token == "x1"  # x: about 6 in all, w about 100


def test_stale_entries_of_the_idle_order_do_not_pile_up() -> None:
    # A release asks whether stale entries pile up once in 64 pushes, and
    # then makes the order afresh. Here 500 entries that never come up (a
    # gone lane's, keyed above every other) are dropped within 64 releases.
    s: SlotScheduler[str] = SlotScheduler({"a": 1})
    held = s.acquire("x0", ["a"], ready=READY, client="x", now=0.0)
    assert isinstance(held, Granted)
    for i in range(100):
        waiting = s.acquire(f"{i}", ["a"], ready=READY, client=("x", "y")[i % 2], now=0.0)
        assert isinstance(waiting, Queued)
    [handoff] = s.release(held.slot, ready=READY, now=1.0)
    gone = _Lane[str](ClientUse(), alive=False)
    s._idle[1].extend((math.inf, 10**9 + i, gone) for i in range(500))  # still a heap
    for step in range(64):
        [handoff] = s.release(handoff.slot, ready=READY, now=2.0 + step)
    assert len(s._idle[1]) <= 2 * len(s._lanes[1]) + 64


def test_after_an_idle_client_that_cannot_use_the_node_the_next_goes_by_its_use_now() -> None:
    # p is idle and first, but waits for b only; a is freed. The next idle
    # client is looked for among the top's children first: q's entry there
    # is from before the other replicas told of q's use, so r goes.
    s: SlotScheduler[str] = SlotScheduler({"a": 1, "b": 1})
    for client, until in (("q", 1.0), ("r", 5.0)):
        s.shares.took(client, 0.0)
        s.shares.released(client, until)
    s.configure_clients({})  # as at start: the idle order is made afresh
    on_a = s.acquire("t0", ["a"], ready=READY, client="t", now=10.0)
    assert isinstance(on_a, Granted)
    assert isinstance(s.acquire("u0", ["b"], ready=READY, client="u", now=10.0), Granted)
    for token, client, order in (("p1", "p", ["b"]), ("q1", "q", ["a"]), ("r1", "r", ["a"])):
        assert isinstance(s.acquire(token, order, ready=READY, client=client, now=10.0), Queued)
    s.told_elsewhere([(10.0, "q", 0, 100.0)], 10.0)  # q idle, at its new use: pushed again
    [handoff] = s.release(on_a.slot, ready=READY, now=11.0)
    assert handoff.waiter.token == "r1"  # q: about 101 slot-seconds, r about 5
