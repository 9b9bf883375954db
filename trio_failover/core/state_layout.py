"""Pure: what the replicas' shared state looks like in Redis, and its small decisions.

Every name starts with ``--state-prefix`` (``P`` below, ``trio-failover:``
by default):

=========================  ==================================================
``P records``              channel: every change record a replica publishes,
                           as an envelope (below)
``P freed``                channel: a freed slot, the message is the node's
                           name (``core/lease_script.py``)
``P slots:NODE``           sorted set: the node's slot leases (lease_script)
``P node:NODE``            hash: the latest record of each field of a node
                           (``FIELD`` -> ``AT_MS JSON-envelope``), what a
                           replica loads when it (re)joins
``P replicas``             sorted set: each replica's id, scored by the
                           expiry of its last beat (Redis' ``TIME``, ms)
=========================  ==================================================

A record is any JSON-serialisable ``dict`` with a ``"kind"`` (the node
board's change records: ``{"kind": "cooldown", "node": ..., "remaining_s":
...}``). It travels in an envelope, ``{"from": REPLICA, "node": NODE|null,
"record": {...}}``, so that a replica skips its own and the record's own
keys are never ours to choose. Records carry remaining seconds, never clock
times (the replicas' clocks differ); a stored record is kept with Redis'
time of its writing (``AT_MS``), so that a replica loading it later learns
its age (``age_s``) and can take it off the remaining seconds.

The heartbeat is a sorted set rather than a key per replica with a TTL:
counting keys needs ``SCAN``, while the set's one script adds ours and
reads every member, in one round trip (the lease's design). A member past
its expiry is left in the set for the replicas that watched it stop
(``judge``): one of them frees its slot leases and drops it, in one
script (``lease_script.REAP``), so a dead replica's slots are free within
seconds rather than one lease TTL.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "HEARTBEAT",
    "PUBLISH",
    "SNAPSHOT",
    "Beats",
    "RemoteRecord",
    "Verdict",
    "decode_envelope",
    "encode_envelope",
    "judge",
    "lease_owner",
    "leases_to_free",
    "node_key",
    "read_heartbeat",
    "read_snapshot",
    "record_field",
    "records_channel",
    "rejoin_delay",
    "replicas_key",
    "share_of",
]

# KEYS[1] the node's hash, or none for a record that is only told;
# ARGV[1] channel, ARGV[2] envelope, ARGV[3] field, ARGV[4] how long the
# hash is kept after its last write, ms. One round trip: stored, then told.
PUBLISH = """
if KEYS[1] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', KEYS[1], ARGV[3], now .. ' ' .. ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return redis.call('PUBLISH', ARGV[1], ARGV[2])
"""

# KEYS: the nodes' hashes. Returns {now_ms, {field, value, ...}, ...}, one
# list per key in order: the snapshot and the clock to age it by, together.
SNAPSHOT = """
local t = redis.call('TIME')
local result = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
for i, key in ipairs(KEYS) do result[i + 1] = redis.call('HGETALL', key) end
return result
"""

# KEYS[1] the replicas' set; ARGV[1] our id, ARGV[2] ttl ms (0 = leave).
# Returns {now_ms, our expiry before this beat or -1, id, expiry_ms, ...}:
# every member after ours was added (or taken out), the expired ones too,
# which only REAP drops (with their leases). The set outlives the last beat
# by that beat's TTL (a shorter beat never shortens it): nothing is left of
# a fleet that stopped.
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local previous = redis.call('ZSCORE', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
local result = {now, previous and tonumber(previous) or -1}
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #members, 2 do
  result[#result + 1] = members[i]
  result[#result + 1] = tonumber(members[i + 1])
end
return result
"""


def records_channel(prefix: str) -> str:
    """The channel of the change records."""
    return f"{prefix}records"


def node_key(prefix: str, node: str) -> str:
    """The hash of ``node``'s latest records (loaded at a join)."""
    return f"{prefix}node:{node}"


def replicas_key(prefix: str) -> str:
    """The sorted set of the live replicas' heartbeats."""
    return f"{prefix}replicas"


@attrs.frozen
class RemoteRecord:
    """A record another replica published, or one loaded from the snapshot.

    Attributes:
        origin: the replica that wrote it (its id).
        node: the node it is about, or None.
        record: the record itself, as its writer passed it (a ``"kind"`` in it).
        age: seconds since it was written, by Redis' clock: 0.0 for a record
            just told, more for one loaded from the snapshot.
    """

    origin: str
    node: str | None
    record: Mapping[str, Any]
    age: float = 0.0


def encode_envelope(origin: str, node: str | None, record: Mapping[str, Any]) -> bytes:
    """The envelope of ``record`` as published and stored.

    Raises:
        ValueError: the record has no string ``"kind"``, or is not JSON-serialisable
            (``TypeError`` from ``json`` becomes this too).
    """
    if not isinstance(record.get("kind"), str):
        raise ValueError(f"a record needs a string 'kind': {record!r}")
    try:
        text = json.dumps({"from": origin, "node": node, "record": dict(record)}, allow_nan=False)
    except (TypeError, ValueError) as exc:  # ValueError: NaN or infinity
        raise ValueError(f"a record must be JSON-serialisable: {exc}") from exc
    return text.encode()


def record_field(record: Mapping[str, Any]) -> str:
    """The field of a node's hash that keeps ``record``: its kind, and its key if it has one.

    ``{"kind": "cooldown", "key": "qwen3"}`` -> ``cooldown:qwen3``: a per-model
    cooldown does not replace another model's, while a later record of the
    same kind and key replaces the earlier one.
    """
    key = record.get("key")
    return str(record["kind"]) if key is None else f"{record['kind']}:{key}"


def decode_envelope(data: bytes, age: float = 0.0) -> RemoteRecord | None:
    """The record in ``data``, or None when it is not one of our envelopes (never raises)."""
    try:
        envelope = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(envelope, dict):
        return None
    origin, node, record = envelope.get("from"), envelope.get("node"), envelope.get("record")
    if not isinstance(origin, str) or not (node is None or isinstance(node, str)):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    return RemoteRecord(origin=origin, node=node, record=record, age=age)


def read_snapshot(reply: object) -> list[RemoteRecord]:
    """The ``SNAPSHOT`` script's reply as records, each with its age; what is not ours is skipped.

    Raises:
        ValueError: the reply is not ``[now_ms, [field, value, ...], ...]``.
    """
    if not (isinstance(reply, list) and reply and isinstance(reply[0], int)):
        raise ValueError(f"unexpected reply to the snapshot script: {reply!r}")
    now_ms = reply[0]
    records: list[RemoteRecord] = []
    for flat in reply[1:]:
        if not isinstance(flat, list) or len(flat) % 2:
            raise ValueError(f"unexpected hash in the snapshot: {flat!r}")
        for value in flat[1::2]:
            stamp, _, data = value.partition(b" ") if isinstance(value, bytes) else (b"", b"", b"")
            if not stamp.isdigit():
                continue
            age = max(0, now_ms - int(stamp)) / 1000
            record = decode_envelope(data, age)
            if record is not None:
                records.append(record)
    return records


@attrs.frozen
class Beats:
    """What one heartbeat saw of the replicas' set, by Redis' clock (milliseconds).

    Attributes:
        now_ms: Redis' clock when the beat was written.
        previous_ms: this replica's own expiry before the beat; None when it
            was not in the set (its first beat, or another replica dropped it).
        expiries: every member's id -> the expiry of its last beat (this
            replica's new one included), the expired ones too.
    """

    now_ms: int
    previous_ms: int | None
    expiries: Mapping[str, int]

    @property
    def live(self) -> int:
        """The replicas whose last beat has not expired, this one included."""
        return sum(expiry > self.now_ms for expiry in self.expiries.values())

    @property
    def lapsed(self) -> bool:
        """This replica's own beat had expired (or was gone) before this one.

        Another replica may have judged it dead and freed its slot leases:
        it takes its running attempts' leases again (as at a join).
        """
        return self.previous_ms is None or self.previous_ms <= self.now_ms


def read_heartbeat(reply: object) -> Beats:
    """The ``HEARTBEAT`` script's reply: ``[now_ms, previous_ms | -1, id, expiry_ms, ...]``.

    Raises:
        ValueError: the reply is not of that shape.
    """
    if not (
        isinstance(reply, list)
        and len(reply) % 2 == 0
        and all(type(item) is int for item in reply[:2])
        and all(type(item) is bytes for item in reply[2::2])
        and all(type(item) is int for item in reply[3::2])
    ):
        raise ValueError(f"unexpected reply to the heartbeat script: {reply!r}")
    now_ms, previous_ms = reply[0], reply[1]
    expiries = {
        member.decode(errors="replace"): expiry
        for member, expiry in zip(reply[2::2], reply[3::2], strict=True)
    }
    return Beats(now_ms, None if previous_ms < 0 else previous_ms, expiries)


@attrs.frozen
class Verdict:
    """Which members of the replicas' set one replica drops (``judge``).

    Attributes:
        dead: replicas whose beat expired while this one watched: their slot
            leases are freed, and announced, now.
        forgotten: replicas whose beat had expired before this one watched,
            longer ago than a lease TTL: their leases have run out on their
            own; only their ids leave the set.
    """

    dead: tuple[str, ...] = ()
    forgotten: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.dead or self.forgotten)


def judge(beats: Beats, me: str, since_ms: int, lease_ttl_ms: int) -> Verdict:
    """Which replicas stopped beating, and which of those this one may declare dead.

    A replica is dead once its last beat has expired (``expiry <= now``),
    but only one that expired after ``since_ms``, the moment this replica
    began to watch (its join, or its own last lapse, by Redis' clock), is
    judged by it: when Redis was away or frozen every beat lapsed, those
    of live replicas too, and a replica that has just come back cannot
    tell them from the dead. Those are left to their lease TTL (and to the
    replicas that watched them stop), and their ids are forgotten once
    their leases have run out (one lease TTL after their expiry).

    Args:
        beats: this replica's heartbeat's reply.
        me: this replica's id (never judged).
        since_ms: when this replica began to watch, by Redis' clock.
        lease_ttl_ms: ``--lease-ttl`` in milliseconds.
    """
    now, dead, forgotten = beats.now_ms, [], []
    for replica, expiry in sorted(beats.expiries.items()):
        if replica == me or expiry > now:
            continue
        if expiry > since_ms:
            dead.append(replica)
        elif expiry <= now - lease_ttl_ms:
            forgotten.append(replica)
    return Verdict(tuple(dead), tuple(forgotten))


def lease_owner(lease_id: str) -> str:
    """The replica that took a lease: its id is the lease id's part before the last ``:``.

    ``SharedState.new_lease_id`` makes them ``REPLICA:COUNTER``.
    """
    return lease_id.rpartition(":")[0]


def leases_to_free(
    dead: Iterable[str], holders: Mapping[str, Sequence[str]]
) -> dict[str, tuple[str, ...]]:
    """The leases of the ``dead`` replicas among each node's ``holders``: node -> lease ids.

    Nodes where none of them held one are left out.
    """
    gone = set(dead)
    freed = {
        node: tuple(lease for lease in leases if lease_owner(lease) in gone)
        for node, leases in holders.items()
    }
    return {node: leases for node, leases in freed.items() if leases}


def share_of(capacity: int, replicas: int) -> int:
    """A replica's share of a node's ``capacity`` while it goes on alone.

    ``capacity`` divided by the live replicas it last saw, rounded down, at
    least 1; ``0`` (no limit) stays ``0``.
    """
    if capacity <= 0:
        return 0
    return max(1, capacity // max(1, replicas))


REJOIN_FIRST = 0.25
REJOIN_MOST = 5.0


def rejoin_delay(failures: int) -> float:
    """Seconds before the next try to (re)join after ``failures`` failed ones in a row.

    Doubles from ``REJOIN_FIRST`` up to ``REJOIN_MOST``: a Redis that is back
    is found within five seconds, and one that is away costs a connect
    attempt every five seconds, not a loop.
    """
    if failures <= 0:
        return 0.0
    return min(REJOIN_MOST, REJOIN_FIRST * math.pow(2, min(failures - 1, 32)))
