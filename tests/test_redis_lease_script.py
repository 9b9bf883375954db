"""The slot lease's pure part: key names, the TTL in milliseconds, reading a take's reply.

The scripts themselves run against a real Redis in ``test_redis_lease.py``.
"""

from __future__ import annotations

import pytest

from trio_failover.core import state_layout
from trio_failover.core.state_layout import LeaseTake, lease_ms, read_take


def test_names_carry_the_prefix() -> None:
    assert state_layout.slots_key("trio-failover:", "gpu-1") == "trio-failover:slots:gpu-1"
    assert state_layout.freed_channel("fleet-b:") == "fleet-b:freed"


@pytest.mark.parametrize(
    ("ttl", "ms"),
    [(30.0, 30_000), (0.1, 100), (0.25, 250), (1.0005, 1001), (0.0001, 1), (1e-9, 1)],
)
def test_lease_ms(ttl: float, ms: int) -> None:
    assert lease_ms(ttl) == ms


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("inf"), float("nan")])
def test_lease_ms_refuses(ttl: float) -> None:
    with pytest.raises(ValueError, match="positive duration"):
        lease_ms(ttl)


@pytest.mark.parametrize(
    ("reply", "take"),
    [
        ([1, 1, 0], LeaseTake(taken=True, in_flight=1)),
        ([1, 4, 0], LeaseTake(taken=True, in_flight=4)),
        ([0, 2, 1500], LeaseTake(taken=False, in_flight=2, retry_after=1.5)),
        ([0, 1, -3], LeaseTake(taken=False, in_flight=1, retry_after=0.0)),
    ],
)
def test_read_take(reply: object, take: LeaseTake) -> None:
    assert read_take(reply) == take


@pytest.mark.parametrize(
    "reply", [None, b"OK", 1, [1, 1], [2, 1, 0], [1, b"1", 0], [True, 1, 0], [1, 1, 0, 0]]
)
def test_read_take_refuses_other_replies(reply: object) -> None:
    with pytest.raises(ValueError, match="unexpected reply"):
        read_take(reply)


@pytest.mark.parametrize(
    "script", [state_layout.TAKE, state_layout.RENEW, state_layout.RELEASE, state_layout.IN_FLIGHT]
)
def test_every_script_reads_redis_clock_and_announces(script: str) -> None:
    # The replicas' clocks never enter: expiry is Redis' own TIME.
    assert "redis.call('TIME')" in script
    assert "ZREMRANGEBYSCORE" in script
    assert "announce()" in script


def test_reap_arguments_name_each_lease_its_slot_set_node_and_owner() -> None:
    keys, args = state_layout.reap_arguments(
        "p:replicas",
        "p:",
        "p:freed",
        ["b", "c"],
        {"gpu-2": ("b:7",), "gpu-1": ("b:1", "c:3")},
    )
    assert keys == ["p:replicas", "p:slots:gpu-1", "p:slots:gpu-2"]
    assert args == [
        "p:freed",
        2,
        "b",
        "c",
        *(2, "gpu-1", "b:1", "b"),
        *(2, "gpu-1", "c:3", "c"),
        *(3, "gpu-2", "b:7", "b"),
    ]
    assert state_layout.reap_arguments("p:replicas", "p:", "p:freed", ["x"], {}) == (
        ["p:replicas"],
        ["p:freed", 1, "x"],
    )


def test_read_reap() -> None:
    assert state_layout.read_reap([]) == {}
    assert state_layout.read_reap([b"b", 2, b"c", 0]) == {"b": 2, "c": 0}


@pytest.mark.parametrize("reply", [None, 1, [b"b"], [b"b", -1], ["b", 1], [b"b", b"1"]])
def test_read_reap_refuses_other_replies(reply: object) -> None:
    with pytest.raises(ValueError, match="reap"):
        state_layout.read_reap(reply)


def test_the_reap_reads_redis_clock_and_announces_each_lease() -> None:
    assert "redis.call('TIME')" in state_layout.REAP
    assert "redis.call('PUBLISH', ARGV[1], node)" in state_layout.REAP
