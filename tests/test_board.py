"""The node board's verbs: the change records they make, what listeners hear, the state left.

No sockets and no clock: every verb takes ``now``.
"""

from __future__ import annotations

import math

import attrs
import pytest

from trio_failover.core.engine_book import EngineChange, EngineSettings
from trio_failover.core.engine_state import EngineRead
from trio_failover.core.engines import Detection, EngineKind, Signals
from trio_failover.core.inventory import CheckFailure, judge_check
from trio_failover.core.liveness import CheckRecord
from trio_failover.core.node_change import ChangeKind, InventoryChange, LastCheck, NodeChange
from trio_failover.proxy.nodes.board import BoardRecord, NodeBoard

COOLING, READY, DOWN, UP, COOLED = (
    ChangeKind.COOLING,
    ChangeKind.READY,
    ChangeKind.DOWN,
    ChangeKind.UP,
    ChangeKind.COOLED,
)
REFUSED = judge_check(failure=CheckFailure.CONNECT_FAILED, detail="refused")
LISTED = judge_check(status=200, body=b'{"object": "list", "data": [{"id": "m"}]}')
SICK = judge_check(status=503, body=b"")


def board_heard(*names: str) -> tuple[NodeBoard, list[NodeChange]]:
    board = NodeBoard(names or ("a", "b"))
    heard: list[NodeChange] = []
    board.listen(lambda record: heard.append(record) if isinstance(record, NodeChange) else None)
    return board, heard


def test_demote_tells_cooling_with_the_seconds_left() -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "header_timeout", 10.0)
    assert heard == [NodeChange(COOLING, "a", "header_timeout", 5.0)]
    assert board.is_demoted("a", 14.9)
    assert not board.is_demoted("a", 15.0)
    assert not board.is_demoted("b", 10.0)
    assert board.wake_at() == 15.0
    assert len(board.cooldowns.active(10.0)) == 1


def test_the_longer_cooldown_wins_and_is_told() -> None:
    board, heard = board_heard()
    board.demote("a", 30.0, "stall", 0.0)
    board.demote("a", 2.0, "rate_limited", 10.0)  # shorter: the stall's runs on
    assert heard[1] == NodeChange(COOLING, "a", "rate_limited", 20.0)
    entry = board.cooldown("a", 10.0)
    assert entry is not None
    assert (entry.reason, entry.until) == ("stall", 30.0)
    board.demote("a", 60.0, "rate_limited", 10.0)  # longer: it replaces
    entry = board.cooldown("a", 10.0)
    assert entry is not None
    assert (entry.reason, entry.until) == ("rate_limited", 70.0)


def test_a_model_cooldown_demotes_the_node_for_that_model_only() -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "header_timeout", 0.0, model="m")
    assert heard == [NodeChange(COOLING, "a", "header_timeout", 5.0, model="m")]
    entry = board.cooldown("a", 1.0, model="m")
    assert entry is not None
    assert entry.until == 5.0
    assert board.cooldown("a", 1.0) is None
    assert board.cooldown("a", 1.0, model="other") is None
    assert not board.is_demoted("a", 1.0)  # asked for no model, or another one
    assert not board.is_demoted("a", 1.0, "other")
    assert board.is_demoted("a", 1.0, "m")
    assert board.is_demoted("a", 1.0, "m:latest")  # the same model
    assert not board.is_demoted("b", 1.0, "m")
    assert board.wake_at() == 5.0
    board.expire(6.0)
    assert heard[1:] == [NodeChange(READY, "a", "expired", model="m")]
    assert board.cooldown("a", 1.0, model="m") is None
    assert board.model_cooldowns.by_model == {}  # the request path's test is empty again


def test_a_model_cooldown_that_ends_on_a_down_node_is_cooled_not_ready() -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "header_timeout", 0.0, model="m")
    board.check_finished("a", REFUSED, 1.0)
    board.expire(6.0)
    assert [(c.kind, c.model) for c in heard] == [(COOLING, "m"), (DOWN, None), (COOLED, "m")]


@pytest.mark.parametrize(
    ("served_model", "ends"), [("m", True), ("m:latest", True), ("other", False), (None, False)]
)
def test_served_for_the_model_ends_its_cooldown(served_model: str | None, ends: bool) -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "header_timeout", 0.0, model="m")
    board.served("a", 200, 1.0, model=served_model)
    assert board.is_demoted("a", 1.0, "m") is not ends
    told = [(c.kind, c.model) for c in heard[1:]]
    assert told == ([(READY, "m")] if ends else [])


def test_node_wide_records_leave_model_cooldowns_alone() -> None:
    board, heard = board_heard()
    board.demote("a", 50.0, "header_timeout", 0.0, model="m")
    board.demote("a", 5.0, "unresponsive", 0.0)
    board.served("a", 200, 1.0)  # no model: the node's cooldown ends, m's runs on
    assert not board.is_demoted("a", 1.0)
    assert board.is_demoted("a", 1.0, "m")
    board.apply(NodeChange(UP, "a", "health_check", model="m"), 1.0)  # a node's kind: ignored
    assert heard[-1] == NodeChange(READY, "a", "success")


def test_a_remote_model_record_applies_and_a_removed_node_forgets_its_models() -> None:
    board, _ = board_heard()
    board.apply(NodeChange(COOLING, "a", "rate_limited", 30.0, model="m"), 10.0)
    assert board.cooldown("a", 39.0, model="m") is not None
    board.reconcile(["b"])
    assert board.cooldown("a", 11.0, model="m") is None
    assert board.model_cooldowns.by_model == {}


@pytest.mark.parametrize(
    ("status", "ends"),
    [(200, True), (404, True), (499, True), (500, False), (503, False)],
)
def test_served_ends_the_cooldown_below_500(status: int, ends: bool) -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "stall", 0.0)
    board.served("a", status, 1.0)
    assert board.nodes["a"].served == 1
    assert board.is_demoted("a", 1.0) is not ends
    assert heard[1:] == ([NodeChange(READY, "a", "success")] if ends else [])


def test_served_clears_down_and_a_ready_node_hears_nothing() -> None:
    board, heard = board_heard()
    board.served("a", 200, 0.0)  # ready already: no news
    board.check_finished("a", REFUSED, 1.0)
    board.served("a", 200, 2.0)
    assert [change.kind for change in heard] == [DOWN, READY]
    assert heard[0].error == REFUSED.last_error
    assert not board.is_down("a")
    assert board.down_count() == 0


def test_served_after_an_unnoticed_expiry_is_no_news() -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "stall", 0.0)
    board.served("a", 200, 9.0)
    assert heard[1:] == [NodeChange(COOLED, "a", "expired")]  # no "ready" news
    assert board.wake_at() == math.inf  # the ended entry is gone


def test_expire_tells_ready_except_for_down_nodes() -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "stall", 0.0)
    board.demote("b", 5.0, "stall", 0.0)
    board.check_finished("b", REFUSED, 1.0)
    heard.clear()
    board.expire(4.0)
    assert heard == []
    board.expire(5.0)
    assert heard == [NodeChange(READY, "a", "expired"), NodeChange(COOLED, "b", "expired")]
    assert board.is_demoted("b", 5.0)  # still down
    assert len(board.cooldowns.active(5.0)) == 0


def test_a_good_check_of_a_cooling_down_node_tells_up_with_the_time_left() -> None:
    board, heard = board_heard()
    board.demote("a", 5.0, "stall", 0.0)
    board.check_finished("a", REFUSED, 1.0)
    record = CheckRecord("health", ok=True, status=None, error=None, at=2.0)
    board.check_finished("a", LISTED, 2.0, record=record)
    assert heard[1:] == [
        NodeChange(DOWN, "a", "health_check", error=REFUSED.last_error),
        NodeChange(UP, "a", "health_check", 3.0),
    ]
    state = board.nodes["a"]
    assert (state.down, state.inventory, state.last_check) == (False, ("m",), record)
    assert board.inventories == {"a": ("m",)}
    assert state.last_outcome == "check_ok"


def test_attempt_ended_keeps_outcome_error_and_counts_failures() -> None:
    board, heard = board_heard()
    board.attempt_ended("a", "header_timeout", "no head in 1 s", failed=True)
    board.attempt_ended("a", "completed", None, failed=False)
    state = board.nodes["a"]
    assert (state.failed, state.last_outcome, state.last_error) == (
        1,
        "completed",
        "no head in 1 s",
    )
    assert heard == []


def test_tags_are_kept_without_news() -> None:
    board, heard = board_heard()
    board.keep_tags("a", [{"name": "m"}])
    assert board.known_tags("a") == [{"name": "m"}]
    assert heard == []


def test_a_failed_liveness_check_marks_the_node_down_and_a_passed_one_brings_it_back() -> None:
    board, heard = board_heard()
    failed = CheckRecord("liveness", ok=False, status=None, error="refused", at=1.0)
    board.liveness_checked("a", failed, 1.0)
    assert board.nodes["a"].last_check is failed
    assert (board.is_down("a"), board.nodes["a"].down_reason) == (True, "unresponsive")
    assert board.nodes["a"].recheck.is_set()  # discovery re-checks it with its backoff
    board.liveness_checked("a", failed, 2.0)  # already down: no news twice
    passed = CheckRecord("liveness", ok=True, status=503, error=None, at=3.0)
    board.liveness_checked("a", passed, 3.0)
    assert not board.is_down("a")
    assert [(c.kind.value, c.reason) for c in heard] == [
        ("down", "unresponsive"),
        ("ready", "health_check"),
    ]


def test_a_passed_liveness_check_leaves_a_health_check_down_mark_alone() -> None:
    """Any status passes a liveness check, a 503 too: the health check's verdict is its own."""
    board, _ = board_heard()
    board.check_finished("a", SICK, 0.0)
    passed = CheckRecord("liveness", ok=True, status=503, error=None, at=1.0)
    board.liveness_checked("a", passed, 1.0)
    assert board.is_down("a")


def test_reconcile_keeps_drops_and_adds() -> None:
    board, _ = board_heard("a", "b")
    board.demote("a", 5.0, "stall", 0.0)
    board.demote("b", 5.0, "stall", 0.0)
    board.check_finished("b", LISTED, 0.0)
    kept = board.nodes["a"]
    kept.served = 3
    retired = board.nodes["b"]
    board.reconcile(["a", "c"])
    assert board.configured == ("a", "c")
    assert board.nodes["a"] is kept
    assert board.nodes["b"] is retired  # its running workloads still write to it
    assert not board.is_down("b")
    board.reconcile(["a", "b", "c"])
    assert board.nodes["b"] is not retired  # added again: afresh
    assert board.is_demoted("a", 1.0)
    assert board.cooldown("b", 1.0) is None
    assert "b" not in board.inventories
    assert board.nodes["c"].served == 0
    assert not board.is_demoted("c", 1.0)


def test_apply_takes_a_remote_record_and_ignores_unknown_nodes() -> None:
    board, heard = board_heard()
    board.apply(NodeChange(COOLING, "a", "stall", 4.0), 100.0)
    board.apply(NodeChange(DOWN, "zz", "health_check"), 100.0)
    assert board.wake_at() == 104.0
    assert heard == [NodeChange(COOLING, "a", "stall", 4.0)]
    board.apply(NodeChange(DOWN, "a", "health_check"), 101.0)
    board.apply(NodeChange(READY, "a", "success"), 102.0)
    assert not board.is_demoted("a", 102.0)


def test_listeners_hear_in_the_order_they_were_added() -> None:
    board = NodeBoard(["a"])
    order: list[str] = []
    board.listen(lambda change: order.append("first"))
    board.listen(lambda change: order.append("second"))
    board.demote("a", 1.0, "stall", 0.0)
    assert order == ["first", "second"]


# -- the engine verbs ----------------------------------------------------------------


def engine_board() -> tuple[NodeBoard, list[EngineChange]]:
    board = NodeBoard(["auto", "fixed"])
    kind = Detection(EngineKind.LLAMA_SERVER, "configured")
    board.configure_engines(
        EngineSettings(
            engines=dict.fromkeys(["auto", "fixed"], kind), auto=frozenset({"auto"}), max_age=6.0
        )
    )
    told: list[EngineChange] = []  # without the read folded (``read``), told below

    def heard(record: BoardRecord) -> None:
        if isinstance(record, EngineChange):
            told.append(attrs.evolve(record, read=None))

    board.listen(heard)
    return board, told


LLAMA = Detection(EngineKind.LLAMA_SERVER, "configured")


def test_engine_read_folds_the_signals_and_tells_capacity_and_change() -> None:
    board, told = engine_board()
    reading = Signals(busy=1, total_slots=4)
    board.apply(EngineRead("auto", LLAMA, reading, 10.0), 10.0)
    board.apply(EngineRead("auto", LLAMA, reading, 12.0), 12.0)  # the same again
    board.apply(EngineRead("fixed", LLAMA, reading, 12.0), 12.0)
    assert told == [
        EngineChange("auto", reading, 4, True, fresh=True),
        EngineChange("auto", reading, 4, False, fresh=True),  # a good read: anchored anew
        EngineChange("fixed", reading, None, True, fresh=True),  # configured: no capacity
    ]
    assert board.engines.signals == {"auto": reading, "fixed": reading}


def test_a_failed_read_keeps_the_last_good_one_until_it_goes_stale() -> None:
    board, told = engine_board()
    board.apply(EngineRead("auto", LLAMA, Signals(busy=2, total_slots=2), 0.0), 0.0)
    board.apply(EngineRead("auto", LLAMA, Signals(last_error="refused"), 5.0), 5.0)
    assert board.engines.signals["auto"].busy == 2
    assert not told[-1].fresh  # a failed read keeps the old anchor
    board.apply(EngineRead("auto", LLAMA, Signals(last_error="refused"), 7.0), 7.0)
    assert "auto" not in board.engines.signals  # older than three intervals: unknown
    # The load goes stale, the capacity does not: a frozen engine's slots
    # do not vanish (the last total_slots holds until it says another).
    assert told[-1] == EngineChange("auto", Signals(), 2, True)  # the load changed


def test_a_remote_read_counts_its_age_and_an_unknown_node_is_ignored() -> None:
    board, told = engine_board()
    board.apply(EngineRead("auto", LLAMA, Signals(busy=1), 93.0, "r2"), 100.0)
    assert "auto" not in board.engines.signals  # read 7 s ago: stale already
    board.apply(EngineRead("gone", LLAMA, Signals(busy=1), 100.0, "r2"), 100.0)
    assert [change.node for change in told] == ["auto"]


def test_a_remote_read_older_than_the_reading_changes_nothing_and_is_not_fresh() -> None:
    board, told = engine_board()
    board.apply(EngineRead("auto", LLAMA, Signals(busy=1, total_slots=2), 10.0), 10.0)
    # Another replica's, taken at 9.5 and heard at 10.2: older than ours.
    board.apply(EngineRead("auto", LLAMA, Signals(busy=2, total_slots=2), 9.5, "r2"), 10.2)
    assert board.engines.signals["auto"].busy == 1
    assert told[-1] == EngineChange("auto", Signals(busy=1, total_slots=2), 2, False)
    # One taken after ours wins, and anchors the count.
    board.apply(EngineRead("auto", LLAMA, Signals(busy=2, total_slots=2), 10.4, "r2"), 10.5)
    assert board.engines.signals["auto"].busy == 2
    assert told[-1].fresh


def test_every_record_goes_to_the_one_listener_list_with_its_origin() -> None:
    board, _ = engine_board()
    heard: list[BoardRecord] = []
    board.listen(heard.append)
    mine = EngineRead("auto", LLAMA, Signals(busy=1), 9.0)
    theirs = EngineRead("fixed", LLAMA, Signals(busy=2), 10.0, origin="r2")
    board.apply(mine, 10.0)
    board.apply(theirs, 10.0)  # another replica's: the same verb, its origin as data
    check = CheckRecord("health", True, 200, None, 10.0)
    board.check_finished("auto", LISTED, 10.0, record=check)
    board.liveness_checked("fixed", attrs.evolve(check, kind="liveness"), 10.0)
    board.apply(InventoryChange("fixed", ("x",), "r2"), 10.0)
    board.apply(LastCheck("gone", check, "r2"), 10.0)  # a node it does not have: ignored
    board.demote("auto", 5.0, "stall", 10.0)
    assert [
        (type(record).__name__, record.read.origin if isinstance(record, EngineChange) else None)
        for record in heard
    ] == [("EngineChange", None), ("EngineChange", "r2")] + [
        (name, None) for name in ("InventoryChange", "LastCheck", "LastCheck")
    ] + [("InventoryChange", None), ("NodeChange", None)]
    assert [r.read for r in heard[:2] if isinstance(r, EngineChange)] == [mine, theirs]
    assert heard[2:5] == [
        InventoryChange("auto", ("m",)),
        LastCheck("auto", check),
        LastCheck("fixed", attrs.evolve(check, kind="liveness")),
    ]
    assert heard[5] == InventoryChange("fixed", ("x",), "r2")
    assert board.nodes["fixed"].inventory == ("x",)
    assert board.inventories == {"auto": ("m",), "fixed": ("x",)}
    assert board.nodes["fixed"].last_check == attrs.evolve(check, kind="liveness")


def test_judging_drops_a_stale_reading() -> None:
    board, told = engine_board()
    board.apply(EngineRead("fixed", LLAMA, Signals(busy=2), 10.0, "r2"), 10.0)
    board.judge_engine("fixed", 16.0)  # six seconds: three intervals, still fresh
    assert "fixed" in board.engines.signals
    assert told[-1] == EngineChange("fixed", Signals(busy=2), None, False)
    board.judge_engine("fixed", 16.5)
    assert "fixed" not in board.engines.signals
    assert told[-1] == EngineChange("fixed", Signals(), None, True)
    board.judge_engine("gone", 16.5)  # a node the book does not have: nothing told
    assert len(told) == 3
