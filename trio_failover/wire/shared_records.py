"""The shared state's records and heartbeat in Redis: publish, snapshot, heartbeat.

A thin shell over ``core/state_layout.py``'s Lua, as ``slot_lease.py`` is
over the lease's: one script, one round trip, per verb. The key and channel
layout is documented there.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core import state_layout
from ..core.errors import StateReplyError
from ..core.state_layout import Beats, RemoteRecord
from .redis import Arg, RedisConnection, Script

__all__ = ["NODE_KEEP", "SharedRecords"]

_PUBLISH = Script(state_layout.PUBLISH)
_SNAPSHOT = Script(state_layout.SNAPSHOT)
_HEARTBEAT = Script(state_layout.HEARTBEAT)
# How long a node's hash outlives its last write: a node removed from every
# replica's configuration leaves nothing behind for ever.
NODE_KEEP = 24 * 3600.0


class SharedRecords:
    """The records' and the heartbeat's verbs over one connection, under one ``--state-prefix``.

    Every verb raises what ``RedisConnection.execute`` raises (``StateTimeout``
    by ``deadline``, ``StateUnavailable``, ``StateReplyError``).
    """

    def __init__(self, connection: RedisConnection, prefix: str = "trio-failover:") -> None:
        self.connection = connection
        self.prefix = prefix
        self.channel = state_layout.records_channel(prefix)

    async def publish(
        self, envelope: bytes, node: str | None, field: str, *, deadline: float
    ) -> None:
        """Tell ``envelope`` on the records channel; with ``node``, store it in its hash too.

        ``envelope`` and ``field`` come from ``core/state_layout.py``'s
        ``encode_envelope`` and ``record_field``: the latest record of each
        field of a node is what a joining replica loads.
        """
        keys = [state_layout.node_key(self.prefix, node)] if node is not None else []
        args: list[Arg] = [self.channel, envelope, field, round(NODE_KEEP * 1000)]
        await self.connection.run_script(_PUBLISH, keys, args, deadline=deadline)

    async def snapshot(self, nodes: Sequence[str], *, deadline: float) -> list[RemoteRecord]:
        """The stored records of ``nodes``, each with its age by Redis' clock."""
        keys = [state_layout.node_key(self.prefix, node) for node in nodes]
        reply = await self.connection.run_script(_SNAPSHOT, keys, [], deadline=deadline)
        try:
            return state_layout.read_snapshot(reply)
        except ValueError as exc:
            raise StateReplyError("snapshot", str(exc)) from exc

    async def heartbeat(self, replica_id: str, ttl: float, *, deadline: float) -> Beats:
        """Say this replica is live for ``ttl`` s more (``ttl`` 0: leave); what the set holds."""
        key = [state_layout.replicas_key(self.prefix)]
        reply = await self.connection.run_script(
            _HEARTBEAT, key, [replica_id, round(ttl * 1000)], deadline=deadline
        )
        try:
            return state_layout.read_heartbeat(reply)
        except ValueError as exc:
            raise StateReplyError("heartbeat", str(exc)) from exc
