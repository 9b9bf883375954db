"""Pure: each client's rpm and tpm windows in the shared state, fleet-wide (docs/sharing.md).

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
"""

from __future__ import annotations

import math

__all__ = ["ADMIT", "CHARGE", "read_admit", "requests_key", "tokens_key"]

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
