"""core/state_layout.py: the shared state's names, envelopes, replies and small decisions (pure)."""

from __future__ import annotations

import pytest

from trio_failover.core import state_layout
from trio_failover.core.state_layout import RemoteRecord, decode_envelope, encode_envelope


def test_names_start_with_the_prefix() -> None:
    assert state_layout.records_channel("p:") == "p:records"
    assert state_layout.node_key("p:", "gpu-1") == "p:node:gpu-1"
    assert state_layout.replicas_key("p:") == "p:replicas"


# capacity, live replicas -> this replica's share while Redis is away.
SHARES = [(0, 3, 0), (1, 2, 1), (4, 2, 2), (5, 2, 2), (3, 4, 1), (8, 1, 8), (8, 0, 8)]


@pytest.mark.parametrize(("capacity", "replicas", "share"), SHARES)
def test_share_of(capacity: int, replicas: int, share: int) -> None:
    assert state_layout.share_of(capacity, replicas) == share


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(0, 0.0), (1, 0.25), (2, 0.5), (3, 1.0), (5, 4.0), (6, 5.0), (10**6, 5.0)],
)
def test_rejoin_delay_doubles_up_to_a_bound(failures: int, delay: float) -> None:
    assert state_layout.rejoin_delay(failures) == delay


def test_an_envelope_round_trips() -> None:
    record = {"kind": "cooldown", "remaining_s": 12.5, "models": ["a"]}
    data = encode_envelope("r1", "gpu-1", record)
    assert decode_envelope(data) == RemoteRecord(origin="r1", node="gpu-1", record=record)
    assert decode_envelope(encode_envelope("r1", None, {"kind": "x"}), 2.0) == RemoteRecord(
        origin="r1", node=None, record={"kind": "x"}, age=2.0
    )


@pytest.mark.parametrize(
    "record", [{}, {"kind": 1}, {"kind": "x", "at": object()}, {"kind": "x", "v": float("nan")}]
)
def test_a_record_without_a_kind_or_not_json_is_refused(record: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="record"):
        encode_envelope("r1", None, record)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff",
        b"[]",
        b'{"from": 1, "node": null, "record": {"kind": "x"}}',
        b'{"from": "a", "node": 2, "record": {"kind": "x"}}',
        b'{"from": "a", "node": null, "record": []}',
        b'{"from": "a", "node": null, "record": {"no": "kind"}}',
    ],
)
def test_what_is_not_our_envelope_is_none(data: bytes) -> None:
    assert decode_envelope(data) is None


def test_a_snapshot_ages_each_record_by_redis_clock() -> None:
    one = encode_envelope("a", "n1", {"kind": "cooldown"})
    two = encode_envelope("b", "n2", {"kind": "down"})
    reply = [
        10_000,
        [b"cooldown", b"7500 " + one, b"junk", b"no stamp", b"bad", b"9000 not json"],
        [],
        [b"down", b"10000 " + two],
    ]
    assert state_layout.read_snapshot(reply) == [
        RemoteRecord(origin="a", node="n1", record={"kind": "cooldown"}, age=2.5),
        RemoteRecord(origin="b", node="n2", record={"kind": "down"}, age=0.0),
    ]


@pytest.mark.parametrize("reply", [None, [], [b"1"], [1, [b"odd"]], [1, b"x"]])
def test_a_snapshot_reply_not_of_our_script_raises(reply: object) -> None:
    with pytest.raises(ValueError, match="snapshot"):
        state_layout.read_snapshot(reply)


def test_heartbeat_replies() -> None:
    assert state_layout.read_heartbeat(3) == 3
    for bad in (-1, b"3", None, True):
        with pytest.raises(ValueError, match="heartbeat"):
            state_layout.read_heartbeat(bad)
