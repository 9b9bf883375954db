"""Pure: what the replicas' shared state looks like in Redis (SPEC 8), and its small decisions.

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
``P replicas``             sorted set: each live replica's id, scored by the
                           expiry of its heartbeat (Redis' ``TIME``, ms)
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
counting keys needs ``SCAN``, while the set's one script drops the expired
members, adds ours and counts, in one round trip (the lease's design).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "HEARTBEAT",
    "PUBLISH",
    "SNAPSHOT",
    "RemoteRecord",
    "decode_envelope",
    "encode_envelope",
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
# Returns the live replicas, ours included (0 after leaving, if alone).
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ttl)
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return redis.call('ZCARD', KEYS[1])
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


def read_heartbeat(reply: object) -> int:
    """The ``HEARTBEAT`` script's reply: the live replicas.

    Raises:
        ValueError: not a count.
    """
    if type(reply) is not int or reply < 0:
        raise ValueError(f"unexpected reply to the heartbeat script: {reply!r}")
    return reply


def share_of(capacity: int, replicas: int) -> int:
    """A replica's share of a node's ``capacity`` while it goes on alone (SPEC 8).

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
