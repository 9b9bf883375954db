"""Usage across replicas: every replica's counts added up in Redis, for ``GET /usage``.

With ``--state redis://…`` each finished request's usage (its tokens, and
the slot-seconds its attempts held) is told here by the report
(``told``, never blocking) and added to what waits to go out, per client
and model. ``publish_all``, a task of the fleet's, writes what waits in
one script (``core/rate_layout.USAGE_ADD``) as soon as there is any; a
batch that could not be written (Redis away, or no answer within
``--state-timeout``) is sent again, with its id, until Redis has it: a
batch that was written after all counts once. So a replica counts
nothing twice and loses nothing while Redis is away, and everything it
counted reaches the fleet's totals when Redis is back.

``document`` is the fleet's ``GET /usage``: Redis' totals and last hour,
plus what waits here to go out; while Redis does not answer, this
replica's own counts since it started (``UsageBook``).
"""

from __future__ import annotations

from typing import Any

import trio

from ...core.usage_book import Counts, Pair, UsageBook, usage_document
from .shared_state import SharedState

RETRY = 1.0  # seconds between two tries of a batch Redis did not take


class FleetUsage:
    """This replica's usage out to Redis, and the fleet's read back."""

    def __init__(self, state: SharedState) -> None:
        self.state = state
        # What waits to go out: pair -> (its model as first asked, counts).
        self._pending: dict[Pair, tuple[str | None, Counts]] = {}
        self._news = trio.Event()

    def told(self, pair: Pair, shown: str | None, counts: Counts) -> None:
        """A finished request's usage, counted here: add it to what goes out (never blocks)."""
        waiting = self._pending.get(pair)
        if waiting is None:
            self._pending[pair] = (shown, _copy(counts))
        else:
            waiting[1].merge(counts)
        self._news.set()

    async def publish_all(self) -> None:
        """Write what waits as it comes (its own task, for the proxy's lifetime)."""
        while True:
            await self._news.wait()
            self._news = trio.Event()
            batch, self._pending = self._pending, {}
            batch_id = self.state.new_lease_id()
            while not await self.state.add_usage(batch_id, batch):
                # Again at a (re)join, or after a while when Redis was only slow.
                with trio.move_on_after(RETRY):
                    await self.state.wait_changed()
            # What came while it was written goes in the next batch.

    async def document(self, book: UsageBook) -> dict[str, Any]:
        """``GET /usage`` for the fleet; this replica's ``book`` while Redis does not answer."""
        now = trio.current_time()
        found = await self.state.read_usage()
        if found is None:
            return book.document(now)
        entries: dict[Pair, tuple[str | None, Counts, Counts]] = dict(found)
        for pair, (shown, counts) in list(self._pending.items()):
            held = entries.get(pair)
            if held is None:
                entries[pair] = (shown, _copy(counts), _copy(counts))
            else:
                held[1].merge(counts)
                held[2].merge(counts)
        return usage_document(
            (pair[0], shown, total, hour) for pair, (shown, total, hour) in entries.items()
        )


def _copy(counts: Counts) -> Counts:
    """A copy of ``counts`` that the caller may add to."""
    copy = Counts()
    copy.merge(counts)
    return copy
