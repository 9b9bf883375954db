"""Table-driven tests of the cooldown table (trio_failover.cooldown).

Times are explicit Trio-clock seconds handed in as ``now``; nothing here
reads a clock. The boundary, stated once: a cooldown from ``since`` until
``until`` covers the half-open interval ``[since, until)``. At ``until``
exactly the node is ready again, and ``expire(until)`` drops the entry.
"""

from __future__ import annotations

import pytest

from trio_failover.core.cooldown import Cooldown, CooldownTable


def _table(*entries: tuple[str, float, float, str]) -> CooldownTable:
    """A table after ``demote(node, now=now, duration=duration, reason=reason)`` calls."""
    table = CooldownTable()
    for node, now, duration, reason in entries:
        table.demote(node, now=now, duration=duration, reason=reason)
    return table


def test_demote_lasts_exactly_duration_from_now() -> None:
    table = CooldownTable()
    entry = table.demote("gpu-a", now=1000.0, duration=120.0, reason="header_timeout")
    assert entry == Cooldown(node="gpu-a", reason="header_timeout", since=1000.0, until=1120.0)
    assert table.get("gpu-a", 1000.0) == entry


# A demotion at now=10.0 for 120 s: until == 130.0.
IS_COOLING = [
    pytest.param(10.0, True, id="at-since"),
    pytest.param(10.5, True, id="just-after-since"),
    pytest.param(70.0, True, id="halfway"),
    pytest.param(129.999, True, id="just-before-until"),
    pytest.param(130.0, False, id="at-until-ready-again"),
    pytest.param(130.001, False, id="just-after-until"),
    pytest.param(10_000.0, False, id="long-after"),
]


@pytest.mark.parametrize(("now", "cooling"), IS_COOLING)
def test_is_cooling_until_until(now: float, cooling: bool) -> None:
    table = _table(("gpu-a", 10.0, 120.0, "header_timeout"))
    assert table.is_cooling("gpu-a", now) is cooling
    assert (table.get("gpu-a", now) is not None) is cooling
    assert ([entry.node for entry in table.active(now)] == ["gpu-a"]) is cooling
    assert not table.is_cooling("gpu-b", now)  # the other nodes are untouched


@pytest.mark.parametrize(
    ("now", "remaining"),
    [
        pytest.param(10.0, 120.0, id="at-since"),
        pytest.param(129.5, 0.5, id="half-a-second-left"),
        pytest.param(130.0, 0.0, id="at-until"),
        pytest.param(500.0, 0.0, id="never-negative"),
    ],
)
def test_remaining(now: float, remaining: float) -> None:
    entry = Cooldown(node="gpu-a", reason="header_timeout", since=10.0, until=130.0)
    assert entry.remaining(now) == remaining


def test_zero_duration_never_cools() -> None:
    table = _table(("gpu-a", 50.0, 0.0, "retryable_response"))
    assert not table.is_cooling("gpu-a", 50.0)
    assert table.active(50.0) == []


# (first demotion, second demotion, the entry that holds afterwards), each
# demotion as (now, duration, reason) and the entry as (since, until, reason).
SECOND_DEMOTION = [
    pytest.param(
        (0.0, 120.0, "header_timeout"),
        (10.0, 200.0, "dead_peer"),
        (10.0, 210.0, "dead_peer"),
        id="longer-second-extends",
    ),
    pytest.param(
        (0.0, 120.0, "header_timeout"),
        (10.0, 5.0, "retryable_response"),
        (0.0, 120.0, "header_timeout"),
        id="shorter-second-does-not-shorten",
    ),
    pytest.param(
        (0.0, 120.0, "header_timeout"),
        (10.0, 0.0, "retryable_response"),
        (0.0, 120.0, "header_timeout"),
        id="zero-second-does-not-end",
    ),
    pytest.param(
        (0.0, 120.0, "header_timeout"),
        (60.0, 60.0, "first_body_timeout"),
        (60.0, 120.0, "first_body_timeout"),
        id="same-end-takes-the-newer",
    ),
    pytest.param(
        (0.0, 10.0, "header_timeout"),
        (50.0, 5.0, "retryable_response"),
        (50.0, 55.0, "retryable_response"),
        id="after-an-unexpired-ended-one",
    ),
]


@pytest.mark.parametrize(("first", "second", "holds"), SECOND_DEMOTION)
def test_second_demotion_keeps_the_longer(
    first: tuple[float, float, str],
    second: tuple[float, float, str],
    holds: tuple[float, float, str],
) -> None:
    table = _table(("gpu-a", *first))
    now, duration, reason = second
    returned = table.demote("gpu-a", now=now, duration=duration, reason=reason)
    since, until, kept_reason = holds
    expected = Cooldown(node="gpu-a", reason=kept_reason, since=since, until=until)
    assert returned == expected
    assert table.get("gpu-a", now) == expected
    assert table.is_cooling("gpu-a", until - 0.001)
    assert not table.is_cooling("gpu-a", until)


def test_restore_ends_early_and_returns_the_entry() -> None:
    table = _table(("gpu-a", 0.0, 120.0, "header_timeout"), ("gpu-b", 0.0, 120.0, "dead_peer"))
    ended = table.restore("gpu-a")
    assert ended == Cooldown(node="gpu-a", reason="header_timeout", since=0.0, until=120.0)
    assert not table.is_cooling("gpu-a", 1.0)
    assert table.is_cooling("gpu-b", 1.0)  # only the restored node
    assert table.restore("gpu-a") is None  # already gone
    assert table.expire(500.0) == [
        Cooldown(node="gpu-b", reason="dead_peer", since=0.0, until=120.0)
    ]


def test_restore_of_a_ready_node_is_none() -> None:
    assert CooldownTable().restore("gpu-a") is None


def test_restore_after_the_end_returns_the_stale_entry() -> None:
    # The caller tells "ended early" from "had already run out" by comparing
    # the returned ``until`` with its own ``now``.
    table = _table(("gpu-a", 0.0, 10.0, "header_timeout"))
    ended = table.restore("gpu-a")
    assert ended is not None
    assert ended.until == 10.0
    assert table.expire(20.0) == []


# Three demotions: a at 0 for 10 (until 10), b at 0 for 20 (until 20),
# c at 5 for 5 (until 10). (now, nodes expire() returns, nodes still active).
EXPIRE = [
    pytest.param(0.0, [], ["a", "b", "c"], id="at-start"),
    pytest.param(9.999, [], ["a", "b", "c"], id="just-before-first-end"),
    pytest.param(10.0, ["a", "c"], ["b"], id="two-end-together"),
    pytest.param(15.0, ["a", "c"], ["b"], id="between"),
    pytest.param(20.0, ["a", "b", "c"], [], id="all-ended"),
]


@pytest.mark.parametrize(("now", "ended", "running"), EXPIRE)
def test_expire_returns_and_removes_only_the_ended(
    now: float, ended: list[str], running: list[str]
) -> None:
    table = _table(
        ("a", 0.0, 10.0, "header_timeout"),
        ("b", 0.0, 20.0, "dead_peer"),
        ("c", 5.0, 5.0, "retryable_response"),
    )
    assert [entry.node for entry in table.active(now)] == running
    assert [entry.node for entry in table.expire(now)] == ended
    assert table.expire(now) == []  # removed: a second call finds nothing
    assert [entry.node for entry in table.active(now)] == running
    for node in running:
        assert table.is_cooling(node, now)
        assert table.restore(node) is not None  # still in the table
    for node in ended:
        assert table.restore(node) is None  # gone from the table


def test_active_skips_ended_but_unexpired_entries() -> None:
    table = _table(("a", 0.0, 10.0, "header_timeout"), ("b", 0.0, 30.0, "header_timeout"))
    assert [entry.node for entry in table.active(10.0)] == ["b"]
    assert table.get("a", 10.0) is None
    # active() is a query: the ended entry is still there for expire().
    assert [entry.node for entry in table.expire(10.0)] == ["a"]


def test_empty_table() -> None:
    table = CooldownTable()
    assert table.get("a", 0.0) is None
    assert not table.is_cooling("a", 0.0)
    assert table.active(0.0) == []
    assert table.expire(0.0) == []
