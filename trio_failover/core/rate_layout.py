"""Pure: each client's rpm and tpm windows, and its usage, in the shared state (docs/sharing.md).

With ``--state redis://`` a client's requests and tokens of the last minute
are counted in Redis, so its ``rpm`` and ``tpm`` hold whichever replica its
requests reach. Two sorted sets per client, under ``--state-prefix``:

- ``{prefix}client:{name}:requests``: one member per admitted request (its
  workload id), scored by Redis' clock in milliseconds;
- ``{prefix}client:{name}:tokens``: one member per ended answer,
  ``{id}:{tokens}``, scored the same way.

The same rule as ``core/limits.py``, one script per verb, on Redis' one
clock (the replicas' own clocks are not comparable): an amount counted at
``t`` is in the window while ``now - t < 60 s``; a request finding the
window holding ``rpm`` requests, or ``tpm`` tokens, is refused with the
milliseconds until it has room, and counted nowhere.

The usage that ``GET /usage`` shows is counted there too, so that any
replica's answer (and a ``--workers`` fleet's admin) covers the fleet:

- ``{prefix}usage``: a hash of running totals, one field per client,
  model and count (``{client}\\x1f{model}\\x1e{count}``), the counts
  ``USAGE_COUNTS``, slot-seconds in milliseconds;
- ``{prefix}usage:minute:{n}``: the same for the minute ``n`` of Redis'
  clock, kept 62 minutes, for the last hour;
- ``{prefix}usage:names``: the model of each client and model as first
  asked (the model of a pair is its ``names.model_key``);
- ``{prefix}usage:batch:{id}``: a batch written already: a batch sent
  again after a timeout (which may have been written) counts once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from .usage_book import Counts, Pair

__all__ = [
    "ADMIT",
    "CHARGE",
    "USAGE_ADD",
    "USAGE_COUNTS",
    "USAGE_READ",
    "minutes_prefix",
    "read_admit",
    "read_usage",
    "requests_key",
    "tokens_key",
    "usage_args",
    "usage_keys",
]

_WINDOW_MS = 60_000

_NOW = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = {_WINDOW_MS}
"""

ADMIT = (
    _NOW
    + """
-- KEYS[1] the client's requests, KEYS[2] its tokens; ARGV[1] rpm, ARGV[2]
-- tpm (0 = no limit), ARGV[3] the request's id.
-- Returns {1, 0} admitted (counted), or {0, ms until the window has room}.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local wait = 0
if rpm > 0 then
  local count = redis.call('ZCARD', KEYS[1])
  if count >= rpm then
    local entry = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    wait = math.max(wait, tonumber(entry[2]) + window - now)
  end
end
if tpm > 0 then
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  local total = 0
  for i = 1, #entries, 2 do
    total = total + tonumber(string.match(entries[i], ':(%d+)$'))
  end
  local over = total - tpm
  if over >= 0 then
    for i = 1, #entries, 2 do
      over = over - tonumber(string.match(entries[i], ':(%d+)$'))
      if over < 0 then
        wait = math.max(wait, tonumber(entries[i + 1]) + window - now)
        break
      end
    end
  end
end
if wait > 0 then return {0, wait} end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
end
return {1, 0}
"""
)

CHARGE = (
    _NOW
    + """
-- KEYS[1] the client's tokens; ARGV[1] the answer's id, ARGV[2] its tokens.
redis.call('ZADD', KEYS[1], now, ARGV[1] .. ':' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], window)
return 1
"""
)


def requests_key(prefix: str, client: str) -> str:
    """The sorted set of ``client``'s admitted requests."""
    return f"{prefix}client:{client}:requests"


def tokens_key(prefix: str, client: str) -> str:
    """The sorted set of ``client``'s charged tokens."""
    return f"{prefix}client:{client}:tokens"


def read_admit(reply: object) -> int | None:
    """``ADMIT``'s reply: None admitted, else the whole seconds (at least 1) to wait.

    Raises:
        ValueError: not such a reply.
    """
    if (
        not isinstance(reply, list)
        or len(reply) != 2
        or not all(isinstance(part, int) for part in reply)
    ):
        raise ValueError(f"unexpected admit reply {reply!r}")
    admitted, wait_ms = int(reply[0]), int(reply[1])
    if admitted == 1:
        return None
    return max(math.ceil(wait_ms / 1000), 1)


# -- usage ----------------------------------------------------------------------------

USAGE_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "estimated", "slot_ms")
_NO_MODEL = "\x00"  # the model part of a request that named none
_HOUR_MINUTES = 60
_MINUTE_KEPT_S = 62 * 60
_BATCH_KEPT_S = 3600

USAGE_ADD = f"""
-- KEYS[1] the totals, KEYS[2] the names, KEYS[3] this batch's mark;
-- ARGV[1] the minutes' key prefix, then per pair: its field, its model as
-- first asked, and the {len(USAGE_COUNTS)} counts. Returns 1, or 0 for a batch written before.
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', {_BATCH_KEPT_S}) then return 0 end
local t = redis.call('TIME')
local minute = ARGV[1] .. math.floor(tonumber(t[1]) / 60)
local counts = {{{", ".join(repr(name) for name in USAGE_COUNTS)}}}
local width = 2 + #counts
for i = 2, #ARGV, width do
  redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
  for j = 1, #counts do
    local n = tonumber(ARGV[i + 1 + j])
    if n ~= 0 then
      local field = ARGV[i] .. '\\30' .. counts[j]
      redis.call('HINCRBY', KEYS[1], field, n)
      redis.call('HINCRBY', minute, field, n)
    end
  end
end
redis.call('EXPIRE', minute, {_MINUTE_KEPT_S})
return 1
"""

USAGE_READ = f"""
-- KEYS[1] the totals, KEYS[2] the names; ARGV[1] the minutes' key prefix.
-- Returns {{totals, names, the last hour's minutes...}} as HGETALL lists.
local t = redis.call('TIME')
local now = math.floor(tonumber(t[1]) / 60)
local out = {{redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}}
for minute = now - {_HOUR_MINUTES - 1}, now do
  out[#out + 1] = redis.call('HGETALL', ARGV[1] .. minute)
end
return out
"""


def usage_keys(prefix: str, batch: str) -> list[str]:
    """``USAGE_ADD``'s keys: the totals, the names, the batch's mark (``USAGE_READ``: two)."""
    return [f"{prefix}usage", f"{prefix}usage:names", f"{prefix}usage:batch:{batch}"]


def minutes_prefix(prefix: str) -> str:
    """The prefix of the minutes' keys (the minute's number follows)."""
    return f"{prefix}usage:minute:"


def _field(pair: Pair) -> str:
    client, model = pair
    return f"{client}\x1f{_NO_MODEL if model is None else model}"


def usage_args(prefix: str, batch: Mapping[Pair, tuple[str | None, Counts]]) -> list[str | int]:
    """``USAGE_ADD``'s arguments for ``batch``: pair -> (its model as first asked, counts)."""
    args: list[str | int] = [minutes_prefix(prefix)]
    for pair, (shown, counts) in batch.items():
        args += [_field(pair), _NO_MODEL if shown is None else shown, *_counted(counts)]
    return args


def _counted(counts: Counts) -> tuple[int, ...]:
    return (
        counts.requests,
        counts.prompt_tokens,
        counts.completion_tokens,
        counts.estimated,
        round(counts.slot_seconds * 1000),
    )


def read_usage(reply: object) -> dict[Pair, tuple[str | None, Counts, Counts]]:
    """``USAGE_READ``'s reply: pair -> (its model as first asked, since start, last hour).

    Raises:
        ValueError: not such a reply.
    """
    if not isinstance(reply, list) or len(reply) < 2:
        raise ValueError(f"unexpected usage reply {reply!r}"[:200])
    names = dict(_pairs(reply[1]))
    found: dict[Pair, tuple[str | None, Counts, Counts]] = {}

    def entry(field: str) -> tuple[Pair, int] | None:
        head, _, count = field.rpartition("\x1e")
        client, _, model = head.partition("\x1f")
        if not client or count not in USAGE_COUNTS:
            return None
        pair = (client, None if model == _NO_MODEL else model)
        if pair not in found:
            shown = names.get(head, model)
            found[pair] = (None if shown == _NO_MODEL else shown, Counts(), Counts())
        return pair, USAGE_COUNTS.index(count)

    for since_start, hashes in ((True, reply[:1]), (False, reply[2:])):
        for fields in hashes:
            for field, value in _pairs(fields):
                place = entry(field)
                if place is not None:
                    _, total, hour = found[place[0]]
                    _add(total if since_start else hour, place[1], int(value))
    return found


def _pairs(fields: object) -> Iterable[tuple[str, str]]:
    if not isinstance(fields, list) or len(fields) % 2:
        raise ValueError(f"unexpected hash {fields!r}"[:200])
    for name, value in zip(fields[::2], fields[1::2], strict=True):
        yield _text(name), _text(value)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str | int):
        return str(value)
    raise ValueError(f"unexpected value {value!r}"[:200])


def _add(counts: Counts, index: int, value: int) -> None:
    if index == 0:
        counts.requests += value
    elif index == 1:
        counts.prompt_tokens += value
    elif index == 2:
        counts.completion_tokens += value
    elif index == 3:
        counts.estimated += value
    else:
        counts.slot_seconds += value / 1000
