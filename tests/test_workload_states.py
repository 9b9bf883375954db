"""The workload's state table (trio_failover.core.workload): every move, and the others."""

from __future__ import annotations

import itertools

import pytest

from trio_failover.core.errors import FailoverError, IllegalTransition
from trio_failover.core.workload import FINAL, TRANSITIONS, State, transition

LEGAL = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets)]
ILLEGAL = [(a, b) for a, b in itertools.product(State, State) if b not in TRANSITIONS[a]]


def test_the_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(State)


@pytest.mark.parametrize(("current", "new"), LEGAL)
def test_every_legal_move(current: State, new: State) -> None:
    assert transition(current, new) is new


@pytest.mark.parametrize(("current", "new"), ILLEGAL)
def test_every_other_move_raises(current: State, new: State) -> None:
    with pytest.raises(IllegalTransition) as caught:
        transition(current, new)
    assert (caught.value.current, caught.value.new) == (current, new)
    assert isinstance(caught.value, FailoverError)


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (State.QUEUED, State.COMMITTED),  # no answer without an attempt
        (State.COMMITTED, State.RUNNING),  # nothing is replayed after commit
        (State.COMPLETED, State.FAILED),
        (State.CANCELLED, State.QUEUED),
    ],
)
def test_named_illegal_moves(current: State, new: State) -> None:
    assert (current, new) in ILLEGAL


def test_final_states_have_no_way_out_and_others_can_end() -> None:
    for state in State:
        assert (TRANSITIONS[state] == frozenset()) == (state in FINAL)
    # Room for the capacity queue: a failed-over workload may wait again.
    assert State.QUEUED in TRANSITIONS[State.RUNNING]


def test_a_walk_through_a_failover_then_a_queue_wait_then_a_stream() -> None:
    state = State.QUEUED
    for new in (
        State.RUNNING,
        State.RUNNING,
        State.QUEUED,
        State.RUNNING,
        State.COMMITTED,
        State.COMPLETED,
    ):
        state = transition(state, new)
    assert state is State.COMPLETED


def test_the_shell_s_workload_moves_only_through_the_table() -> None:
    from trio_failover.proxy.records import Workload

    work = Workload(id="w", method="GET", path="/", started=0.0)
    with pytest.raises(IllegalTransition):
        work.state = State.COMMITTED  # no answer without an attempt
    assert work.state is State.QUEUED
    work.state = State.RUNNING
    work.state = State.COMMITTED
    with pytest.raises(IllegalTransition):
        work.state = State.RUNNING  # a committed workload is never replayed
