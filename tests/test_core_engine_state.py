"""Pure: a node's engine state between reads, and the slot decisions that read it."""

from __future__ import annotations

import pytest

from trio_failover.core.engine_state import (
    EngineRead,
    EngineState,
    attempt_head_timeout,
    auto_capacity,
    loaded_nodes,
    next_state,
)
from trio_failover.core.engines import UNKNOWN, Detection, EngineKind, Signals, failed
from trio_failover.core.slots import SlotLedger, SlotScheduler, Take, Wait, choose_node

LLAMA = Detection(EngineKind.LLAMA_SERVER, "configured")
GOOD = Signals(busy=1, total_slots=2)


def read(signals: Signals, at: float) -> EngineRead:
    return EngineRead("n", LLAMA, signals, at)


# -- folding reads into a state --------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "signals", "after"),
    [
        pytest.param(
            EngineState(),
            GOOD,
            EngineState(engine=LLAMA, signals=GOOD, read_at=10.0),
            id="first good read",
        ),
        pytest.param(
            EngineState(engine=LLAMA, signals=GOOD, read_at=4.0, last_error="x", error_at=6.0),
            Signals(busy=2, total_slots=2),
            EngineState(engine=LLAMA, signals=Signals(busy=2, total_slots=2), read_at=10.0),
            id="a good read clears the error",
        ),
        pytest.param(
            EngineState(engine=LLAMA, signals=GOOD, read_at=4.0),
            failed("GET /slots: timeout"),
            EngineState(
                engine=LLAMA,
                signals=GOOD,
                read_at=4.0,
                last_error="GET /slots: timeout",
                error_at=10.0,
            ),
            id="a failed read keeps the last good one and its date",
        ),
        pytest.param(
            EngineState(engine=LLAMA, signals=GOOD, read_at=4.0),
            Signals(total_slots=4, last_error="GET /slots: not JSON"),
            EngineState(
                engine=LLAMA,
                signals=Signals(busy=1, total_slots=4),
                read_at=4.0,
                last_error="GET /slots: not JSON",
                error_at=10.0,
            ),
            id="a partial read lays its fields over the last good one",
        ),
        pytest.param(
            EngineState(),
            failed("GET /props: connect timed out"),
            EngineState(engine=LLAMA, last_error="GET /props: connect timed out", error_at=10.0),
            id="a failed first read knows nothing",
        ),
        pytest.param(
            EngineState(engine=LLAMA, signals=GOOD, read_at=12.0),
            Signals(busy=2, total_slots=2),
            EngineState(engine=LLAMA, signals=GOOD, read_at=12.0),
            id="a good read older than the state's (a late remote one) changes nothing",
        ),
        pytest.param(
            EngineState(engine=LLAMA, signals=GOOD, read_at=10.0, last_error="x", error_at=11.0),
            Signals(busy=2, total_slots=2),
            EngineState(engine=LLAMA, signals=Signals(busy=2, total_slots=2), read_at=10.0),
            id="one of the same moment replaces it",
        ),
    ],
)
def test_next_state(before: EngineState, signals: Signals, after: EngineState) -> None:
    assert next_state(before, read(signals, 10.0)) == after


@pytest.mark.parametrize(
    ("read_at", "now", "current"),
    [(None, 0.0, UNKNOWN), (0.0, 6.0, GOOD), (0.0, 6.001, UNKNOWN), (10.0, 11.0, GOOD)],
)
def test_a_state_is_unknown_after_three_intervals(
    read_at: float | None, now: float, current: Signals
) -> None:
    state = EngineState(engine=LLAMA, signals=GOOD, read_at=read_at)
    assert state.current(now, max_age=6.0) == current


LCP = Detection(EngineKind.LLAMA_CPP_PYTHON, 'GET /v1/models: owned_by "me" with permissions')
FROM_SLOTS = "auto (GET /props total_slots)"
NONE = "auto (the engine gives none)"


@pytest.mark.parametrize(
    ("state", "capacity"),
    [
        (EngineState(engine=LLAMA, signals=Signals(total_slots=4), read_at=9.0), (4, FROM_SLOTS)),
        pytest.param(
            EngineState(engine=LLAMA, signals=Signals(busy=2, total_slots=2), read_at=0.0),
            (2, FROM_SLOTS),
            id="stale-total-slots-hold",  # its busy count is unknown by now (below)
        ),
        pytest.param(
            EngineState(
                engine=LLAMA,
                signals=Signals(total_slots=2),
                read_at=0.0,
                last_error="GET /props: no whole answer in 2.0s",
                error_at=9.0,
            ),
            (2, FROM_SLOTS),
            id="reads-failing-since",
        ),
        (EngineState(engine=LLAMA, signals=Signals(total_slots=0), read_at=9.0), (0, NONE)),
        (EngineState(engine=LLAMA), (0, NONE)),
        (EngineState(), (0, NONE)),  # auto, not detected yet
        (EngineState(signals=Signals(busy=3), read_at=9.0), (0, NONE)),
        pytest.param(
            EngineState(engine=LCP, read_at=9.0),
            (1, "auto (llama-cpp-python serves one request at a time)"),
            id="llama-cpp-python-one",
        ),
    ],
)
def test_auto_capacity(state: EngineState, capacity: tuple[int, str]) -> None:
    assert (auto_capacity(state).value, auto_capacity(state).source) == capacity


def test_stale_signals_are_unknown_but_their_capacity_holds() -> None:
    state = next_state(EngineState(), read(Signals(busy=2, total_slots=2), 0.0))
    state = next_state(state, read(failed("GET /slots: no whole answer in 2.0s"), 8.0))
    assert state.current(now=10.0, max_age=6.0) == UNKNOWN
    assert auto_capacity(state).value == 2


OLLAMA_A = Signals(loaded=frozenset({"qwen3:latest"}), loaded_is_complete=True)
OLLAMA_B = Signals(loaded=frozenset(), loaded_is_complete=True)
LMSTUDIO = Signals(loaded=frozenset({"m"}), not_loaded=frozenset({"n"}))


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("qwen3", {"a"}),  # NAME is NAME:latest
        ("qwen3:latest", {"a"}),
        ("qwen3:8b", set()),
        ("m", {"lm"}),
        (None, set()),
    ],
)
def test_loaded_nodes(model: str | None, expected: set[str]) -> None:
    signals = {"a": OLLAMA_A, "b": OLLAMA_B, "lm": LMSTUDIO, "llama": GOOD}
    assert loaded_nodes(model, signals) == expected


@pytest.mark.parametrize(
    ("signals", "model", "timeout"),
    [
        (OLLAMA_B, "qwen3", 300.0),  # known not loaded: a cold load
        (OLLAMA_A, "qwen3", 120.0),
        (LMSTUDIO, "n", 300.0),
        (LMSTUDIO, "other", 120.0),  # LM Studio does not list it: unknown
        (GOOD, "qwen3", 120.0),
        (None, "qwen3", 120.0),
        (OLLAMA_B, None, 120.0),
    ],
)
def test_attempt_head_timeout(signals: Signals | None, model: str | None, timeout: float) -> None:
    got = attempt_head_timeout(
        signals, model, response_header_timeout=120.0, cold_start_timeout=300.0
    )
    assert got == timeout


# -- the ledger and the order with signals ---------------------------------------------


def ledger(signals: dict[str, Signals], capacity: int = 2) -> SlotLedger:
    return SlotLedger({"a": capacity, "b": capacity}, signals)


@pytest.mark.parametrize(
    ("in_flight", "busy", "capacity", "full"),
    [
        (0, None, 2, False),
        (2, None, 2, True),  # the proxy's own count
        (0, 2, 2, True),  # the engine's: work of other clients
        (1, 1, 2, False),  # not added: the engine counts the proxy's own too
        (0, 9, 0, False),  # capacity 0 is no limit
    ],
)
def test_full_by_either_count(in_flight: int, busy: int | None, capacity: int, full: bool) -> None:
    book = ledger({"a": Signals(busy=busy)}, capacity)
    for _ in range(in_flight):
        book.take("a")
    assert book.is_full("a") is full


def test_without_signals_the_ledger_counts_as_before() -> None:
    book = ledger({})
    book.take("a")
    assert (book.is_full("a"), book.load("a")) == (False, 0.5)


@pytest.mark.parametrize(
    ("at_reading", "busy", "now", "engine_busy", "full"),
    [
        (2, 2, 1, 1, False),  # this proxy freed one: free at once, not at the next read
        (3, 3, 2, 2, False),
        (0, 3, 0, 3, True),  # three of other clients stay until the engine says otherwise
        (1, 2, 0, 1, False),  # one of the proxy's, one of another client's
        (1, 2, 2, 3, True),  # the other client's one plus this proxy's two now
        (2, 0, 2, 2, False),  # the engine had not started ours yet: never below our count
        (0, 1, 2, 3, True),  # taken since the reading: added to the other client's
    ],
)
def test_a_reading_moves_with_this_proxys_own_takes_and_releases(
    at_reading: int, busy: int, now: int, engine_busy: int, full: bool
) -> None:
    signals: dict[str, Signals] = {}
    book = ledger(signals, capacity=3)
    held = [book.take("a") for _ in range(at_reading)]
    signals["a"] = Signals(busy=busy)  # read with ``at_reading`` of ours in flight
    book.note_reading("a")
    while len(held) > now:
        book.release(held.pop())
    while len(held) < now:
        held.append(book.take("a"))
    assert (book.engine_busy("a"), book.is_full("a")) == (engine_busy, full)
    assert book.load("a") == engine_busy / 3


def test_without_an_anchor_the_reading_is_max_of_both_counts() -> None:
    book = ledger({"a": Signals(busy=2, waiting=1)}, capacity=4)
    book.take("a")
    assert (book.engine_busy("a"), book.load("a")) == (2, 0.75)
    assert book.engine_busy("b") is None


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        ({}, "a"),  # ties in resolved order
        ({"a": Signals(busy=1)}, "b"),  # max(in_flight, busy)
        ({"a": Signals(busy=0, waiting=1)}, "b"),  # waiting counts
        ({"a": Signals(busy=1), "b": Signals(busy=1)}, "a"),
        ({"b": Signals(waiting=3)}, "a"),
    ],
)
def test_least_loaded_key_counts_the_engine(signals: dict[str, Signals], expected: str) -> None:
    book = SlotLedger({"a": 4, "b": 4}, signals)
    choice = choose_node(
        ["a", "b"], tried=set(), ready={"a", "b"}, ledger=book, balance="least-loaded"
    )
    assert choice == Take(expected)


@pytest.mark.parametrize(
    ("loaded", "full", "balance", "expected"),
    [
        (frozenset(), set(), "priority", Take("a")),
        (frozenset({"b"}), set(), "priority", Take("b")),
        (frozenset({"b"}), {"b"}, "priority", Take("a")),  # full: the others, not a wait
        (frozenset({"b", "c"}), set(), "least-loaded", Take("b")),
        (frozenset({"a", "b"}), {"a", "b", "c"}, "priority", Wait(("a", "b", "c"))),
    ],
)
def test_loaded_models_first_among_the_free_ready_nodes(
    loaded: frozenset[str], full: set[str], balance: str, expected: object
) -> None:
    book = SlotLedger({"a": 1, "b": 1, "c": 1})
    for node in full:
        book.take(node)
    choice = choose_node(
        ["a", "b", "c"],
        tried=set(),
        ready={"a", "b", "c"},
        ledger=book,
        balance=balance,  # type: ignore[arg-type]
        loaded=loaded,
    )
    assert choice == expected


def test_a_loaded_node_that_is_cooling_stays_behind_the_ready_ones() -> None:
    book = SlotLedger({"a": 0, "b": 0})
    choice = choose_node(["a", "b"], tried=set(), ready={"a"}, ledger=book, loaded={"b"})
    assert choice == Take("a")


def test_set_capacity_lets_a_waiter_on_at_the_next_dispatch() -> None:
    scheduler: SlotScheduler[str] = SlotScheduler({"a": 1})
    scheduler.acquire("first", ["a"], ready={"a"})
    queued = scheduler.acquire("second", ["a"], ready={"a"})
    assert scheduler.dispatch(ready={"a"}) == []
    assert scheduler.ledger.set_capacity("a", 2) is True
    assert scheduler.ledger.set_capacity("a", 2) is False
    handoffs = scheduler.dispatch(ready={"a"})
    assert [h.waiter.token for h in handoffs] == ["second"]
    assert queued is not None
    with pytest.raises(KeyError):
        scheduler.ledger.set_capacity("z", 1)
    with pytest.raises(ValueError, match="int >= 0"):
        scheduler.ledger.set_capacity("a", -1)


def test_an_engine_full_node_keeps_a_waiter_until_its_signal_drops() -> None:
    signals: dict[str, Signals] = {"a": Signals(busy=1)}
    scheduler: SlotScheduler[str] = SlotScheduler({"a": 1}, signals=signals)
    queued = scheduler.acquire("w", ["a"], ready={"a"})
    assert type(queued).__name__ == "Queued"
    assert scheduler.dispatch(ready={"a"}) == []
    signals["a"] = Signals(busy=0)
    assert [h.waiter.token for h in scheduler.dispatch(ready={"a"})] == ["w"]
