"""Pure: what the replicas' shared state looks like in Redis: its names, its
Lua, the reading of the scripts' replies, and the small decisions on them.

``wire/slot_lease.py`` runs the scripts (``EVALSHA``, then ``EVAL`` once the
server says ``NOSCRIPT``); this module holds the text, the key names and
the reading of the replies, so that all of it is tested without Redis. The
records themselves, and their envelope, are ``core/fleet_records.py``'s.
The keys and channels, the heartbeat and the slot lease's design are told
in docs/replicas.md ("In Redis: keys, channels, records", "The slot
lease"). Requires Redis 5 or later: a script that reads ``TIME`` and then
writes is replicated by its effects, the default since 5.0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

__all__ = [
    "HEARTBEAT",
    "IN_FLIGHT",
    "PUBLISH",
    "REAP",
    "RELEASE",
    "RENEW",
    "SNAPSHOT",
    "TAKE",
    "Beats",
    "LeaseTake",
    "Verdict",
    "freed_channel",
    "judge",
    "lease_ms",
    "lease_owner",
    "leases_to_free",
    "node_key",
    "read_freed",
    "read_heartbeat",
    "read_reap",
    "read_take",
    "reap_arguments",
    "records_channel",
    "rejoin_delay",
    "replicas_key",
    "share_of",
    "slots_key",
    "wanted_channel",
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


# KEYS[1] the node's lease set; ARGV[1] lease id, ARGV[2] node name (the
# message), ARGV[3] the freed channel. `freed` counts the leases that end
# in this script; `now` is Redis' clock in milliseconds.
_PROLOGUE = """
local key, id, node, channel = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local freed = redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local function keep_until_last(ttl)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIREAT', key, tonumber(last[2]) + ttl) end
end
local function announce()
  if freed > 0 then redis.call('PUBLISH', channel, node) end
end
"""

TAKE = (
    _PROLOGUE
    + """
-- ARGV[4] capacity (0 = no limit), ARGV[5] ttl in ms, ARGV[6] the wanted
-- channel, told the node's name when a take is refused (a replica that
-- kept a spare lease there gives it back).
-- Returns {1, in_flight, 0} taken (a lease already held is renewed, so a
-- take retried after a lost reply does not count twice), or
-- {0, in_flight, ms until the oldest lease ends} refused.
local capacity, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local held = redis.call('ZSCORE', key, id)
local count = redis.call('ZCARD', key)
local result
if held or capacity <= 0 or count < capacity then
  redis.call('ZADD', key, now + ttl, id)
  if not held then count = count + 1 end
  keep_until_last(ttl)
  result = {1, count, 0}
else
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  result = {0, count, tonumber(first[2]) - now}
  if ARGV[6] then redis.call('PUBLISH', ARGV[6], node) end
end
announce()
return result
"""
)

RENEW = (
    _PROLOGUE
    + """
-- ARGV[4] ttl in ms. Returns 1 renewed, 0 the lease was gone (expired).
local ttl = tonumber(ARGV[4])
local result = 0
if redis.call('ZSCORE', key, id) then
  redis.call('ZADD', key, now + ttl, id)
  keep_until_last(ttl)
  result = 1
end
announce()
return result
"""
)

RELEASE = (
    _PROLOGUE
    + """
-- ARGV[4] capacity (0 = no limit), ARGV[5] 1 when the releasing replica saw
-- the node full (by an engine's count too), ARGV[6] the releasing replica.
-- The freed slot is announced only when someone may be waiting for it: the
-- node was full before this release (a take may have been refused), or the
-- replica saw it full. Leases that expired are announced without a replica:
-- they were nobody's to release. Returns 1 released, 0 the lease was
-- already gone (expired, or released).
local capacity, seen_full, origin = tonumber(ARGV[4]), ARGV[5] == '1', ARGV[6]
local before = redis.call('ZCARD', key)
local removed = redis.call('ZREM', key, id)
if freed > 0 then
  announce()
elseif removed == 1 and (seen_full or (capacity > 0 and before >= capacity)) then
  redis.call('PUBLISH', channel, node .. ' ' .. origin)
end
return removed
"""
)

IN_FLIGHT = (
    _PROLOGUE
    + """
-- Returns the leases held now at the node, by every replica.
announce()
return redis.call('ZCARD', key)
"""
)

# KEYS[1] the replicas' set (HEARTBEAT), KEYS[2..] slot sets.
# ARGV[1] the freed channel, ARGV[2] n, ARGV[3..2+n] the replicas to drop,
# then one row of four per lease to free: the index of its slot set in
# KEYS, the node's name, the lease id, the replica that took it.
# A replica is dropped only if its beat is still past its expiry: one that
# beat again since it was judged is alive. Only a dropped replica's leases
# are freed, each announced as an expiry (the node's name alone) so that
# the waiters of every replica ask again; the replicas that judged the same
# death meanwhile find it gone and free nothing twice.
# Returns {id, leases freed, ...} for each replica dropped.
REAP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(ARGV[2])
local dropped, freed, order = {}, {}, {}
for i = 3, 2 + n do
  local id = ARGV[i]
  local expiry = redis.call('ZSCORE', KEYS[1], id)
  if expiry and tonumber(expiry) <= now then
    redis.call('ZREM', KEYS[1], id)
    dropped[id] = true
    freed[id] = 0
    order[#order + 1] = id
  end
end
for i = 3 + n, #ARGV, 4 do
  local key, node, lease, owner = KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if dropped[owner] and redis.call('ZREM', key, lease) == 1 then
    redis.call('PUBLISH', ARGV[1], node)
    freed[owner] = freed[owner] + 1
  end
end
local result = {}
for _, id in ipairs(order) do
  result[#result + 1] = id
  result[#result + 1] = freed[id]
end
return result
"""


@attrs.frozen
class LeaseTake:
    """What a take said.

    Attributes:
        taken: the slot is ours until renewed or released.
        in_flight: leases held at the node now, by every replica, ours included.
        retry_after: seconds until the oldest lease ends when refused (a waiter
            asks again then, in case its holder died); ``0.0`` when taken.
    """

    taken: bool
    in_flight: int
    retry_after: float = 0.0


def slots_key(prefix: str, node: str) -> str:
    """The sorted set of ``node``'s leases (``--state-prefix`` first)."""
    return f"{prefix}slots:{node}"


def freed_channel(prefix: str) -> str:
    """The channel on which a freed slot is announced (``read_freed`` reads its messages)."""
    return f"{prefix}freed"


def wanted_channel(prefix: str) -> str:
    """The channel on which a refused take names its node: spare leases there are given back."""
    return f"{prefix}wanted"


def read_freed(message: str) -> tuple[str, str]:
    """A freed announcement as (node, releasing replica); the replica is "" for an expiry.

    The message is the node's name, then for a release a space and the
    replica's id (node names hold no space: ``core/config.py``).
    """
    node, _, origin = message.partition(" ")
    return node, origin


def lease_ms(ttl: float) -> int:
    """``--lease-ttl`` in the scripts' whole milliseconds, rounded up, at least 1.

    Raises:
        ValueError: ``ttl`` is not a positive finite number of seconds.
    """
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"a lease TTL must be a positive duration, not {ttl!r}")
    return max(1, math.ceil(ttl * 1000 - 1e-9))


def read_take(reply: object) -> LeaseTake:
    """The ``TAKE`` script's reply as a ``LeaseTake``.

    Raises:
        ValueError: the reply is not ``[0|1, count, ms]``; the script under
            that SHA is not ours.
    """
    if not (
        isinstance(reply, list)
        and len(reply) == 3
        and all(isinstance(item, int) and not isinstance(item, bool) for item in reply)
        and reply[0] in (0, 1)
    ):
        raise ValueError(f"unexpected reply to the take script: {reply!r}")
    taken, count, wait_ms = reply
    return LeaseTake(taken=taken == 1, in_flight=count, retry_after=max(0, wait_ms) / 1000)


def reap_arguments(
    replicas_key: str,
    prefix: str,
    freed: str,
    drop: Sequence[str],
    leases: Mapping[str, Sequence[str]],
) -> tuple[list[str], list[str | int]]:
    """``REAP``'s keys and arguments: drop the replicas ``drop``, free ``leases`` (node -> ids).

    Each lease's owner is ``lease_owner`` of its id; the script
    frees it only if that owner is dropped in the same step.

    Args:
        replicas_key: the replicas' set (``replicas_key``).
        prefix: ``--state-prefix``, for the nodes' slot sets.
        freed: the freed channel (``freed_channel``).
        drop: the replicas to drop, if their beat is still expired.
        leases: the leases to free at each node.
    """
    nodes = sorted(leases)
    keys = [replicas_key, *(slots_key(prefix, node) for node in nodes)]
    args: list[str | int] = [freed, len(drop), *drop]
    for index, node in enumerate(nodes, start=2):
        for lease in leases[node]:
            args += [index, node, lease, lease_owner(lease)]
    return keys, args


def read_reap(reply: object) -> dict[str, int]:
    """The ``REAP`` script's reply: each replica dropped -> the leases freed of it.

    Raises:
        ValueError: the reply is not ``[id, count, ...]``.
    """
    if not (
        isinstance(reply, list)
        and len(reply) % 2 == 0
        and all(type(item) is bytes for item in reply[::2])
        and all(type(item) is int and item >= 0 for item in reply[1::2])
    ):
        raise ValueError(f"unexpected reply to the reap script: {reply!r}")
    return {
        replica.decode(errors="replace"): count
        for replica, count in zip(reply[::2], reply[1::2], strict=True)
    }


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
