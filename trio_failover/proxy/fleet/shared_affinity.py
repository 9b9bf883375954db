"""Cache affinity across replicas: what each replica's nodes served, told to the others.

With ``--state redis://…`` every replica publishes a ``served`` record
(``core/affinity.Served``, carried by ``core/fleet_records.py``) for each
request its nodes answered, and applies the others' to its own memory
(``CacheAffinity.apply``), so a conversation's turns prefer one node
whichever replica they reach. The request path only queues the record
(``told``, never blocking); ``publish_all``, a task of the fleet's, sends
it within ``--state-timeout``, and a record that finds the outbox full is
dropped: a missed record costs a cache miss, never a wait.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import trio

from ...core import fleet_records
from ...core.affinity import Served
from ...core.fleet_records import RemoteRecord
from ...telemetry.logs import logger
from ..nodes.affinity import CacheAffinity
from .shared_state import SharedState

SERVED = "served"  # the record's kind
OUTBOX = 10_000  # records waiting to go out; more while Redis is slow are dropped


class FleetAffinity:
    """The served records out to the other replicas, and theirs in."""

    def __init__(self, affinity: CacheAffinity, state: SharedState, nodes: Container[str]) -> None:
        self.affinity = affinity
        self.state = state
        self.nodes = nodes  # the board's, live across reloads
        self._send, self._outbox = trio.open_memory_channel[tuple[dict[str, Any], str]](OUTBOX)
        affinity.share = self.told

    def told(self, record: Served) -> None:
        """A request served here: queue its record for ``publish_all`` (never blocks)."""
        try:
            self._send.send_nowait((fleet_records.encode(record, 0.0), record.node))
        except trio.WouldBlock:
            logger.debug(
                "shared state: a record was dropped", extra={"fields": {"node": record.node}}
            )

    async def publish_all(self) -> None:
        """Send the records as they come (its own task, for the proxy's lifetime)."""
        async for record, node in self._outbox:
            await self.state.publish(record, node=node)

    def on_record(self, remote: RemoteRecord) -> None:
        """Apply another replica's ``served`` record (its node one of ours)."""
        if remote.node not in self.nodes:
            return
        record = fleet_records.decode(remote, trio.current_time())
        if isinstance(record, Served):
            self.affinity.apply(record)
