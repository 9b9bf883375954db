"""The clients' rpm and tpm windows and their usage in Redis: ``core/rate_layout.py``'s scripts.

One round trip per verb.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core import rate_layout
from ..core.errors import StateReplyError
from ..core.usage_book import Counts, Pair
from .redis import RedisConnection, Script

__all__ = ["ClientRates"]

_ADMIT = Script(rate_layout.ADMIT)
_CHARGE = Script(rate_layout.CHARGE)
_USAGE_ADD = Script(rate_layout.USAGE_ADD)
_USAGE_READ = Script(rate_layout.USAGE_READ)


class ClientRates:
    """Admit a client's request, and charge its tokens, fleet-wide.

    Every verb raises what ``RedisConnection.execute`` raises (``StateTimeout``
    by ``deadline``, ``StateUnavailable``, ``StateReplyError``).
    """

    def __init__(self, connection: RedisConnection, prefix: str) -> None:
        self.connection = connection
        self.prefix = prefix

    async def admit(
        self, client: str, request_id: str, *, rpm: int, tpm: int, deadline: float
    ) -> int:
        """Count the request if ``client``'s window has room: 0, else the seconds to wait."""
        keys = [
            rate_layout.requests_key(self.prefix, client),
            rate_layout.tokens_key(self.prefix, client),
        ]
        reply = await self.connection.run_script(
            _ADMIT, keys, [rpm, tpm, request_id], deadline=deadline
        )
        try:
            wait = rate_layout.read_admit(reply)
        except ValueError as exc:
            raise StateReplyError("admit", f"{exc}") from exc
        return 0 if wait is None else wait

    async def charge(self, client: str, answer_id: str, tokens: int, *, deadline: float) -> None:
        """Count ``tokens`` of ``client``'s ended answer ``answer_id`` now."""
        keys = [rate_layout.tokens_key(self.prefix, client)]
        await self.connection.run_script(_CHARGE, keys, [answer_id, tokens], deadline=deadline)

    async def add_usage(
        self, batch_id: str, batch: Mapping[Pair, tuple[str | None, Counts]], *, deadline: float
    ) -> None:
        """Count ``batch`` (pair -> its model as first asked, counts) now, once per ``batch_id``."""
        keys = rate_layout.usage_keys(self.prefix, batch_id)
        args = rate_layout.usage_args(self.prefix, batch)
        await self.connection.run_script(_USAGE_ADD, keys, args, deadline=deadline)

    async def read_usage(self, *, deadline: float) -> dict[Pair, tuple[str | None, Counts, Counts]]:
        """Every pair's model as first asked, counts since start and in the last hour."""
        keys = rate_layout.usage_keys(self.prefix, "")[:2]
        args = [rate_layout.minutes_prefix(self.prefix)]
        reply = await self.connection.run_script(_USAGE_READ, keys, args, deadline=deadline)
        try:
            return rate_layout.read_usage(reply)
        except ValueError as exc:
            raise StateReplyError("usage", f"{exc}") from exc
