"""core/state_layout.py: the shared state's names, replies and small decisions (pure)."""

from __future__ import annotations

import pytest

from trio_failover.core import state_layout
from trio_failover.core.state_layout import Beats, Verdict


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


def test_heartbeat_replies() -> None:
    reply = [10_000, 11_500, b"a", 13_000, b"b", 9_000, b"c", 10_000]
    beats = state_layout.read_heartbeat(reply)
    assert beats == Beats(10_000, 11_500, {"a": 13_000, "b": 9_000, "c": 10_000})
    assert beats.live == 1  # c's expiry is now: expired, as Redis' ZREMRANGEBYSCORE counts it
    assert not beats.lapsed
    assert state_layout.read_heartbeat([10_000, -1, b"a", 13_000]).previous_ms is None
    for bad in (-1, 3, b"3", None, True, [1], [1, -1, b"a"], [1, -1, "a", 2], [1, -1, b"a", b"2"]):
        with pytest.raises(ValueError, match="heartbeat"):
            state_layout.read_heartbeat(bad)


# this replica's expiry before its beat, Redis' clock now -> whether its beat had lapsed.
@pytest.mark.parametrize(
    ("previous_ms", "now_ms", "lapsed"),
    [(None, 10_000, True), (9_999, 10_000, True), (10_000, 10_000, True), (10_001, 10_000, False)],
)
def test_a_beat_has_lapsed_once_its_expiry_is_past(
    previous_ms: int | None, now_ms: int, lapsed: bool
) -> None:
    assert Beats(now_ms, previous_ms, {"me": now_ms + 3_000}).lapsed is lapsed


TTL_MS = 30_000  # --lease-ttl
# (the others' expiries, when this replica began to watch, now) -> (dead, forgotten).
# "me" is never judged; an expiry equal to now has expired.
JUDGEMENTS = [
    pytest.param({}, 0, 10_000, (), (), id="alone"),
    pytest.param({"b": 12_000}, 0, 10_000, (), (), id="beating"),
    pytest.param({"b": 10_000}, 0, 10_000, ("b",), (), id="expired-now"),
    pytest.param({"b": 9_000, "c": 8_000}, 5_000, 10_000, ("b", "c"), (), id="two-died"),
    pytest.param({"b": 9_000}, 9_500, 10_000, (), (), id="expired-before-we-watched"),
    pytest.param({"b": 9_000}, 9_000, 10_000, (), (), id="expired-as-we-began"),
    pytest.param({"b": 9_001}, 9_000, 10_000, ("b",), (), id="expired-just-after"),
    pytest.param({"b": 11_000}, 40_000, 41_000, (), ("b",), id="forgotten-a-ttl-later"),
    pytest.param({"b": 11_001}, 40_000, 41_000, (), (), id="not-yet-forgotten"),
    pytest.param({"b": 1_000}, 0, 41_000, ("b",), (), id="watched-long-ago-still-dead"),
    pytest.param({"me": 9_000}, 0, 10_000, (), (), id="never-myself"),
]


@pytest.mark.parametrize(("others", "since_ms", "now_ms", "dead", "forgotten"), JUDGEMENTS)
def test_judge(
    others: dict[str, int],
    since_ms: int,
    now_ms: int,
    dead: tuple[str, ...],
    forgotten: tuple[str, ...],
) -> None:
    beats = Beats(now_ms, now_ms + 2_000, {"me": now_ms + 3_000, **others})
    verdict = state_layout.judge(beats, "me", since_ms, TTL_MS)
    assert verdict == Verdict(dead, forgotten)
    assert bool(verdict) is bool(dead or forgotten)


@pytest.mark.parametrize(
    ("lease", "owner"),
    [("a1b2c3:7", "a1b2c3"), ("host:1:12", "host:1"), ("no-counter", ""), (":3", "")],
)
def test_a_lease_is_its_replicas(lease: str, owner: str) -> None:
    assert state_layout.lease_owner(lease) == owner


def test_leases_to_free_are_the_dead_replicas_at_each_node() -> None:
    holders = {"gpu-1": ["b:1", "a:4", "b:2"], "gpu-2": ["a:5"], "gpu-3": [], "gpu-4": ["c:1"]}
    assert state_layout.leases_to_free(["b", "c"], holders) == {
        "gpu-1": ("b:1", "b:2"),
        "gpu-4": ("c:1",),
    }
    assert state_layout.leases_to_free([], holders) == {}


BEAT_MS = 1_000  # a beat each second
LIVES_MS = 3 * BEAT_MS  # a beat lasts three


@pytest.mark.parametrize("killed_ms", [5_000, 5_001, 5_500, 5_999])
@pytest.mark.parametrize("offset_ms", [0, 1, 500, 999])
def test_a_replica_killed_at_t_is_judged_dead_by_the_next_beat_after_t_plus_three(
    killed_ms: int, offset_ms: int
) -> None:
    """A timeline, by Redis' clock: A beats at 1000, 2000...; B at offset, offset+1000...

    B is killed at ``killed_ms`` (after its beat of that instant, if any).
    Each of A's beats is judged with the reply it would get; the first that
    says "B is dead" is the instant B's slots are freed: no later than
    B's death + 4 s (its last beat lasted 3 s; A's next beat is at most 1 s
    after that expiry), well within the 5 s promised.
    """
    b_beats = list(range(offset_ms, killed_ms + 1, BEAT_MS))
    b_expiry = b_beats[-1] + LIVES_MS
    judged = None
    for now in range(BEAT_MS, 20_000, BEAT_MS):  # A's beats (B's first one is in)
        expiries = {"a": now + LIVES_MS, "b": max(t for t in b_beats if t <= now) + LIVES_MS}
        beats = Beats(now, now - BEAT_MS + LIVES_MS, expiries)
        if state_layout.judge(beats, "a", 0, TTL_MS).dead == ("b",):
            judged = now
            break
    assert judged is not None
    # The first of A's beats at or after B's last beat's expiry, exactly.
    assert judged == -(-b_expiry // BEAT_MS) * BEAT_MS
    assert judged - killed_ms <= LIVES_MS + BEAT_MS < 5_000
