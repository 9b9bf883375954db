"""The shared state's scripts in Redis: the slot lease, the records, the heartbeat.

A thin shell over ``core/state_layout.py``'s Lua: one script, one round
trip, per verb (docs/replicas.md). ``SlotLeases``: take, renew, release,
want, reap; the release is posted, its answer read later. ``SharedRecords``:
publish a record, load the snapshot, beat. The key and channel layout is
documented in ``core/state_layout.py``. Lease ids
are the caller's (unique per attempt, e.g. the replica's id and a
counter), so that a take retried after a lost reply, or a release after a
take that timed out, finds the same lease.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..core import fleet_records, state_layout
from ..core.errors import StateError, StateReplyError
from ..core.fleet_records import RemoteRecord
from ..core.state_layout import Beats, LeaseTake
from .redis import Arg, RedisConnection, Script, checked

__all__ = ["LeaseTake", "SharedRecords", "SlotLeases"]

_TAKE = Script(state_layout.TAKE)
_RENEW = Script(state_layout.RENEW)
_IN_FLIGHT = Script(state_layout.IN_FLIGHT)
_REAP = Script(state_layout.REAP)
_PUBLISH = Script(state_layout.PUBLISH)
_SNAPSHOT = Script(state_layout.SNAPSHOT)
_HEARTBEAT = Script(state_layout.HEARTBEAT)
# How long a node's hash outlives its last write: a node removed from every
# replica's configuration leaves nothing behind for ever.
NODE_KEEP = 24 * 3600.0


class SlotLeases:
    """The lease verbs over one Redis connection, under one ``--state-prefix``.

    Every verb raises what ``RedisConnection.execute`` raises (``StateTimeout``
    by ``deadline``, ``StateUnavailable``, ``StateReplyError``).
    """

    def __init__(self, connection: RedisConnection, prefix: str = "trio-failover:") -> None:
        self.connection = connection
        self.prefix = prefix
        self.freed_channel = state_layout.freed_channel(prefix)
        self.wanted_channel = state_layout.wanted_channel(prefix)

    def _args(self, node: str, lease_id: str) -> tuple[list[str], list[str]]:
        return [state_layout.slots_key(self.prefix, node)], [lease_id, node, self.freed_channel]

    async def take(
        self, node: str, lease_id: str, *, capacity: int, ttl: float, deadline: float
    ) -> LeaseTake:
        """Take a slot at ``node`` if fewer than ``capacity`` are held fleet-wide.

        Args:
            node: the node's name.
            lease_id: this attempt's lease; taking one already held renews it.
            capacity: the node's capacity; ``0`` = no limit (the lease is
                still counted in the fleet-wide in-flight count).
            ttl: seconds the lease lasts unless renewed (``--lease-ttl``).
            deadline: Trio time by which Redis must have answered.

        Returns:
            Taken or not, the in-flight count, and when refused, the seconds
            until the oldest lease ends (ask again then, or on a ``freed``
            message, whichever is first). A refusal is told on the
            ``wanted`` channel.
        """
        keys, args = self._args(node, lease_id)
        tail: list[Arg] = [*args, capacity, state_layout.lease_ms(ttl), self.wanted_channel]
        reply = await self.connection.run_script(_TAKE, keys, tail, deadline=deadline)
        try:
            return state_layout.read_take(reply)
        except ValueError as exc:
            raise StateReplyError("take", f"{exc}") from exc

    async def renew(self, node: str, lease_id: str, *, ttl: float, deadline: float) -> bool:
        """Extend the lease by ``ttl`` from now; False when it had already expired."""
        keys, args = self._args(node, lease_id)
        reply = await self.connection.run_script(
            _RENEW, keys, [*args, state_layout.lease_ms(ttl)], deadline=deadline
        )
        return reply == 1

    async def release(
        self,
        node: str,
        lease_id: str,
        *,
        capacity: int,
        seen_full: bool,
        origin: str,
        deadline: float,
        on_answer: Callable[[bool | StateError], None],
    ) -> bool:
        """End the lease without waiting for Redis' answer (``RedisConnection.post``).

        The slot is announced freed (``NODE ORIGIN``) when a waiter may be
        hoping for it: the node held ``capacity`` leases or more before, or
        ``seen_full`` (the releasing replica saw it full, by an engine's
        count too). Sent as ``EVAL`` with the source: a posted command has
        nobody to retry it after a ``NOSCRIPT``. ``on_answer`` gets True
        (released), False (already gone) or the error, from the task that
        reads the answer. Returns
        False when nothing was written (the connection is closed, or
        ``deadline`` passed first).
        """
        keys, args = self._args(node, lease_id)
        command: list[Arg] = ["EVAL", state_layout.RELEASE, len(keys), *keys, *args]
        command += [capacity, int(seen_full), origin]

        def answered(replies: list[object] | StateError) -> None:
            if isinstance(replies, StateError):
                on_answer(replies)
                return
            try:
                on_answer(checked("release", replies[0]) == 1)
            except StateReplyError as exc:
                on_answer(exc)

        return await self.connection.post([command], deadline=deadline, on_replies=answered)

    async def want(self, node: str, *, deadline: float) -> bool:
        """Tell the ``wanted`` channel that a workload here waits for ``node``; not waited for.

        A replica keeping a spare lease there gives it back. For a waiter
        that asked Redis nothing (its replica saw the node full by the
        engine's count); a refused take tells the channel by itself.
        Returns False when nothing was written (``RedisConnection.post``).
        """
        command: list[Arg] = ["PUBLISH", self.wanted_channel, node]
        return await self.connection.post([command], deadline=deadline, on_replies=_ignore)

    async def holders(self, nodes: Sequence[str], *, deadline: float) -> dict[str, list[str]]:
        """Every lease held at each of ``nodes`` now (expired ones not yet dropped too).

        One pipeline of ``ZRANGE``; for ``state_layout.leases_to_free``.
        """
        if not nodes:
            return {}
        keys = [state_layout.slots_key(self.prefix, node) for node in nodes]
        replies = await self.connection.pipeline(
            [("ZRANGE", key, 0, -1) for key in keys], deadline=deadline
        )
        holders: dict[str, list[str]] = {}
        for node, reply in zip(nodes, replies, strict=True):
            if not isinstance(reply, list):
                raise StateReplyError("holders", f"unexpected reply {reply!r}")
            holders[node] = []
            for item in reply:
                if not isinstance(item, bytes):
                    raise StateReplyError("holders", f"unexpected member {item!r}")
                holders[node].append(item.decode(errors="replace"))
        return holders

    async def reap(
        self, drop: Sequence[str], leases: Mapping[str, Sequence[str]], *, deadline: float
    ) -> dict[str, int]:
        """Drop the replicas ``drop`` from the live set and free ``leases``, in one step.

        A replica is dropped only if its beat is still expired, and only a
        dropped replica's leases are freed, each announced on the freed
        channel (``state_layout.REAP``). Returns each replica dropped here
        -> the leases freed of it (a replica another one dropped first is
        not in it).
        """
        keys, args = state_layout.reap_arguments(
            state_layout.replicas_key(self.prefix), self.prefix, self.freed_channel, drop, leases
        )
        reply = await self.connection.run_script(_REAP, keys, args, deadline=deadline)
        try:
            return state_layout.read_reap(reply)
        except ValueError as exc:
            raise StateReplyError("reap", f"{exc}") from exc

    async def in_flight(self, node: str, *, deadline: float) -> int:
        """The leases held at ``node`` now, by every replica."""
        keys, args = self._args(node, "")
        reply = await self.connection.run_script(_IN_FLIGHT, keys, args, deadline=deadline)
        if not isinstance(reply, int):
            raise StateReplyError("in_flight", f"unexpected reply {reply!r}")
        return reply


def _ignore(replies: list[object] | StateError) -> None:
    """A told ``wanted`` needs no answer: a lost one only costs a waiter its hurry."""


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

        ``envelope`` and ``field`` come from ``core/fleet_records.py``'s
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
            return fleet_records.read_snapshot(reply)
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
