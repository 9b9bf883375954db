"""The pure parts of sharing a fleet: clients' names, priorities, use, rate windows, fair order.

Tables at exact instants (``now`` passed in); the whole proxy's behaviour is
in test_sharing.py.
"""

from __future__ import annotations

import math

import pytest

from trio_failover.core.limits import RateBook, Window, retry_after
from trio_failover.core.rate_layout import read_admit
from trio_failover.core.sharing import (
    HALF_LIFE,
    ShareBook,
    client_from_header,
    priority_rank,
    request_priority,
)
from trio_failover.core.slots import Granted, Queued, QueueFull, SlotScheduler

C = HALF_LIFE / math.log(2)
HIGH, NORMAL, LOW = 0, 1, 2


# -- names and priorities --------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (None, "anonymous"),
        (b"", "anonymous"),
        (b"alice", "alice"),
        (b"alice@example.com", "alice@example.com"),
        (b"id:42.x_y-z", "id:42.x_y-z"),
        (b"a" * 128, "a" * 128),
        (b"a" * 129, None),
        (b"alice smith", None),
        (b"al/ice", None),
        (b"\xc3\xa9", None),
    ],
)
def test_a_client_header_names_a_client(value: bytes | None, name: str | None) -> None:
    assert client_from_header(value) == name


@pytest.mark.parametrize(
    ("rank", "header", "expected"),
    [
        (NORMAL, None, NORMAL),
        (NORMAL, b"low", LOW),
        (HIGH, b" LOW ", LOW),
        (LOW, b"high", LOW),  # never raised
        (NORMAL, b"high", NORMAL),
        (HIGH, b"whatever", HIGH),
    ],
)
def test_a_request_may_only_lower_its_priority(
    rank: int, header: bytes | None, expected: int
) -> None:
    assert request_priority(rank, header) == expected


def test_priority_ranks() -> None:
    assert [priority_rank(p) for p in ("high", "normal", "low")] == [HIGH, NORMAL, LOW]


# -- use: decaying slot-seconds --------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "now", "expected"),
    [
        ([], 0.0, 0.0),
        ([("took", 0.0)], 0.0, 0.0),
        ([("took", 0.0)], 60.0, C / 2),  # running: counted up to now
        ([("took", 0.0), ("released", 60.0)], 60.0, C / 2),
        ([("took", 0.0), ("released", 60.0)], 120.0, C / 4),  # one half-life later
        ([("took", 0.0), ("took", 0.0), ("released", 60.0)], 60.0, C),  # two at once
        ([("took", 100.0), ("released", 101.0)], 101.0, C * (1 - 2 ** (-1 / 60))),
        # Far on (the epoch moves): the same numbers.
        ([("took", 5000.0), ("released", 5060.0)], 5120.0, C / 4),
        ([("took", 0.0), ("released", 60.0), ("took", 9000.0)], 9060.0, C / 2),
        # A day on: the stored sums would overflow a float without the moves.
        ([("took", 0.0), ("released", 60.0), ("took", 86_400.0)], 86_460.0, C / 2),
    ],
)
def test_use_is_slot_seconds_with_a_one_minute_half_life(
    events: list[tuple[str, float]], now: float, expected: float
) -> None:
    book = ShareBook()
    for verb, at in events:
        getattr(book, verb)("x", at)
    assert book.use("x", now) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_weights_limits_and_a_reload() -> None:
    book = ShareBook({"x": (2.0, 1)})
    book.took("x", 0.0)
    assert book.at_limit("x")
    assert not book.at_limit("y")
    book.configure({"x": (1.0, 0)})
    assert not book.at_limit("x")
    assert book.clients["x"].weight == 1.0


def test_idle_clients_are_forgotten_unless_kept() -> None:
    book = ShareBook()
    for name in ("gone", "kept"):
        book.took(name, 0.0)
        book.released(name, 1.0)
    book.took("busy", 0.0)
    book.forget(500.0, {"kept"})
    assert set(book.clients) == {"busy", "kept", "gone"}  # "gone" still counts 2**-8
    book.forget(10_000.0, {"kept"})
    assert set(book.clients) == {"busy", "kept"}
    assert book.use("busy", 10_000.0) == pytest.approx(C, rel=1e-6)


# -- rpm and tpm windows ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("admits", "now", "expected"),
    [
        ([0.0, 10.0], 20.0, None),
        ([0.0, 10.0, 20.0], 30.0, 30),  # the one at 0 leaves at 60
        ([0.0, 10.0, 20.0], 59.5, 1),  # rounded up
        ([0.0, 10.0, 20.0], 59.0, 1),
        ([0.0, 10.0, 20.0], 60.0, None),  # exactly a minute on: out
        ([0.0, 0.0, 0.0], 0.25, 60),
    ],
)
def test_rpm_at_exact_instants(admits: list[float], now: float, expected: int | None) -> None:
    book = RateBook()
    for at in admits:
        assert book.admit("x", at, 3, 0) is None
    assert book.admit("x", now, 3, 0) == expected


def test_a_refused_request_counts_toward_nothing() -> None:
    book = RateBook()
    for at in (0.0, 1.0, 2.0):
        assert book.admit("x", at, 3, 0) is None
    assert book.admit("x", 30.0, 3, 0) == 30
    assert book.held("x", 30.0) == (3, 0)
    assert book.admit("x", 60.0, 3, 0) is None  # room again: the refused one did not count


@pytest.mark.parametrize(
    ("charges", "now", "expected"),
    [
        ([(5.0, 99)], 10.0, None),
        ([(5.0, 100)], 10.0, 55),
        ([(5.0, 60), (20.0, 60)], 30.0, 35),  # the one at 5 leaves room at 65
        ([(5.0, 60), (20.0, 60), (25.0, 100)], 30.0, 55),  # both earlier must leave: 80
        ([(5.0, 100)], 65.0, None),
    ],
)
def test_tpm_at_exact_instants(
    charges: list[tuple[float, int]], now: float, expected: int | None
) -> None:
    book = RateBook()
    for at, tokens in charges:
        book.charge("x", at, tokens)
    assert book.admit("x", now, 0, 100) == expected


def test_the_longer_wait_of_rpm_and_tpm_is_the_answer() -> None:
    book = RateBook()
    assert book.admit("x", 0.0, 1, 10) is None
    book.charge("x", 30.0, 10)
    assert book.admit("x", 40.0, 1, 10) == 50  # tpm's, not rpm's 20
    window = Window()
    assert retry_after(window, 0.0, 0) is None


def test_empty_windows_are_forgotten() -> None:
    book = RateBook()
    book.admit("x", 0.0, 5, 0)
    book.forget(30.0)
    assert book.held("x", 30.0) == (1, 0)
    book.forget(60.0)
    assert not book._requests


# -- the scheduler's fair order --------------------------------------------------------


def scheduler(capacities: dict[str, int], **kw: object) -> SlotScheduler[str]:
    return SlotScheduler(capacities, **kw)  # type: ignore[arg-type]


def queue(s: SlotScheduler[str], token: str, client: str, now: float, **kw: object) -> None:
    order = kw.pop("order", ("a",))
    result = s.acquire(token, order, ready={"a", "b"}, client=client, now=now, **kw)  # type: ignore[arg-type]
    assert isinstance(result, Queued), result


def test_a_freed_slot_goes_to_the_client_that_used_the_fleet_least() -> None:
    s = scheduler({"a": 1})
    first = s.acquire("x0", ["a"], ready={"a"}, client="x", now=0.0)
    assert isinstance(first, Granted)
    for token in ("x1", "x2", "x3"):
        queue(s, token, "x", 0.0)
    queue(s, "y1", "y", 1.0)
    [handoff] = s.release(first.slot, ready={"a"}, now=10.0)
    assert handoff.waiter.token == "y1"  # y has used nothing
    [handoff] = s.release(handoff.slot, ready={"a"}, now=20.0)
    assert handoff.waiter.token == "x1"  # within a client: the longest-waiting
    assert s.use("x", 20.0) == pytest.approx(C * (2 ** (-10 / 60) - 2 ** (-20 / 60)), rel=1e-9)


def test_first_come_first_served_with_fair_share_off() -> None:
    s = scheduler({"a": 1}, fair=False)
    first = s.acquire("x0", ["a"], ready={"a"}, client="x", now=0.0)
    assert isinstance(first, Granted)
    queue(s, "x1", "x", 0.0)
    queue(s, "y1", "y", 1.0)
    [handoff] = s.release(first.slot, ready={"a"}, now=10.0)
    assert handoff.waiter.token == "x1"


def test_lower_use_divided_by_weight_goes_first() -> None:
    s = scheduler({"a": 5})
    s.configure_clients({"heavy": (3.0, 0)})
    light = [s.acquire(f"l0{i}", ["a"], ready={"a"}, client="light", now=0.0) for i in range(2)]
    for i in range(3):
        assert isinstance(s.acquire(f"h0{i}", ["a"], ready={"a"}, client="heavy"), Granted)
    queue(s, "l1", "light", 0.0)
    queue(s, "h1", "heavy", 0.0)
    # At 10 s light has used 20 slot-seconds (one runs on), heavy 30 of weight 3.
    assert isinstance(light[0], Granted)
    [handoff] = s.release(light[0].slot, ready={"a"}, now=10.0)
    assert handoff.waiter.token == "h1"


def test_the_highest_priority_goes_first_whatever_its_use() -> None:
    s = scheduler({"a": 1})
    first = s.acquire("h0", ["a"], ready={"a"}, client="h", rank=HIGH, now=0.0)
    assert isinstance(first, Granted)
    queue(s, "n1", "n", 0.0, rank=NORMAL)
    queue(s, "h1", "h", 1.0, rank=HIGH)
    [handoff] = s.release(first.slot, ready={"a"}, now=10.0)
    assert handoff.waiter.token == "h1"


def test_a_waiter_that_cannot_use_the_freed_node_leaves_it_to_the_next_client() -> None:
    s = scheduler({"a": 1, "b": 1})
    on_a = s.acquire("x0", ["a"], ready={"a", "b"}, client="x", now=0.0)
    on_b = s.acquire("x1", ["b"], ready={"a", "b"}, client="x", now=0.0)
    assert isinstance(on_a, Granted)
    assert isinstance(on_b, Granted)
    queue(s, "only-b", "idle", 0.0, order=("b",))  # the best client, but b only
    queue(s, "x2", "x", 0.0, order=("a", "b"))
    [handoff] = s.release(on_a.slot, ready={"a", "b"}, now=5.0)
    assert handoff.waiter.token == "x2"
    [handoff] = s.release(on_b.slot, ready={"a", "b"}, now=6.0)
    assert handoff.waiter.token == "only-b"


@pytest.mark.parametrize("fair", [True, False])
def test_max_in_flight_waits_with_slots_free_and_takes_its_own_freed_one(fair: bool) -> None:
    s = scheduler({"a": 0}, fair=fair)  # no capacity limit at all
    s.configure_clients({"x": (1.0, 1)})
    first = s.acquire("x0", ["a"], ready={"a"}, client="x", now=0.0)
    assert isinstance(first, Granted)
    queue(s, "x1", "x", 0.0)
    other = s.acquire("y0", ["a"], ready={"a"}, client="y", now=0.0)
    assert isinstance(other, Granted)  # others are not held up
    [handoff] = s.release(first.slot, ready={"a"}, now=3.0)
    assert handoff.waiter.token == "x1"
    assert s.release(other.slot, ready={"a"}, now=4.0) == []


def test_a_full_queue_displaces_the_newest_waiter_of_the_lowest_priority() -> None:
    s = scheduler({"a": 1}, max_queue=3)
    assert isinstance(s.acquire("n0", ["a"], ready={"a"}, client="n", now=0.0), Granted)
    queue(s, "low1", "b", 0.0, rank=LOW)
    queue(s, "low2", "b", 1.0, rank=LOW)
    queue(s, "normal1", "n", 2.0, rank=NORMAL)
    # A newcomer of the lowest priority displaces no one:
    assert isinstance(s.acquire("low3", ["a"], ready={"a"}, client="b", rank=LOW), QueueFull)
    result = s.acquire("high1", ["a"], ready={"a"}, client="h", rank=HIGH, now=3.0)
    assert isinstance(result, Queued)
    assert result.displaced is not None
    assert (result.displaced.token, result.displaced.displaced) == ("low2", True)
    result = s.acquire("normal2", ["a"], ready={"a"}, client="n", rank=NORMAL, now=4.0)
    assert isinstance(result, Queued)
    assert result.displaced is not None
    assert result.displaced.token == "low1"
    # Now nothing below normal is left: a normal newcomer is refused itself.
    assert isinstance(s.acquire("normal3", ["a"], ready={"a"}, client="n"), QueueFull)
    assert [w.token for w in s.waiting()] == ["normal1", "high1", "normal2"]


def test_the_displaced_waiter_is_the_newest_of_all_clients_of_that_priority() -> None:
    s = scheduler({"a": 1}, max_queue=3)
    assert isinstance(s.acquire("n0", ["a"], ready={"a"}, client="n", now=0.0), Granted)
    queue(s, "x1", "x", 0.0, rank=LOW)
    queue(s, "y1", "y", 1.0, rank=LOW)
    queue(s, "x2", "x", 2.0, rank=LOW)
    result = s.acquire("n1", ["a"], ready={"a"}, client="n", rank=NORMAL, now=3.0)
    assert isinstance(result, Queued)
    assert result.displaced is not None
    assert result.displaced.token == "x2"
    result = s.acquire("n2", ["a"], ready={"a"}, client="n", rank=NORMAL, now=4.0)
    assert isinstance(result, Queued)
    assert result.displaced is not None
    assert result.displaced.token == "y1"


def test_dispatch_hands_out_in_fair_order() -> None:
    s = scheduler({"a": 1})
    assert isinstance(s.acquire("z0", ["a"], ready={"a"}, client="z", now=0.0), Granted)
    for token, client in (("x1", "x"), ("x2", "x"), ("y1", "y")):
        queue(s, token, client, 0.0)
    s.ledger.set_capacity("a", 3)
    handoffs = s.dispatch(ready={"a"}, now=1.0)
    assert [h.waiter.token for h in handoffs] == ["x1", "y1"]  # then x runs, y is idle


@pytest.mark.parametrize(
    ("reply", "expected"),
    [([1, 0], None), ([0, 1], 1), ([0, 1000], 1), ([0, 1001], 2), ([0, 59_999], 60)],
)
def test_the_fleet_windows_answer_in_whole_seconds(reply: list[int], expected: int | None) -> None:
    assert read_admit(reply) == expected


@pytest.mark.parametrize("reply", [None, [1], ["1", 0], [1, 0, 0]])
def test_a_strange_fleet_answer_is_an_error(reply: object) -> None:
    with pytest.raises(ValueError, match="unexpected admit reply"):
        read_admit(reply)


def test_the_idle_clients_order_survives_a_move_of_the_epoch_and_a_reload() -> None:
    s = scheduler({"a": 1})
    for client, until in (("p", 10.0), ("q", 20.0)):
        s.shares.took(client, 0.0)
        s.shares.released(client, until)
    held = s.acquire("z0", ["a"], ready={"a"}, client="z", now=20.0)
    assert isinstance(held, Granted)
    queue(s, "q1", "q", 20.0)
    queue(s, "p1", "p", 20.0)
    queue(s, "p2", "p", 20.0)
    # Far later (the book's epoch moves): p has used less, as before.
    [handoff] = s.release(held.slot, ready={"a"}, now=1810.0)
    assert handoff.waiter.token == "p1"
    # q's weight grows tenfold: now q goes ahead of p, idle both again.
    s.configure_clients({"q": (10.0, 0)})
    [handoff] = s.release(handoff.slot, ready={"a"}, now=1810.0)
    assert handoff.waiter.token == "q1"
