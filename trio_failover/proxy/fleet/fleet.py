"""One replica in a fleet of replicas: the node board and the slots over Redis.

Only a proxy with ``--state redis://...`` imports this module (it pulls in
the Redis client, ``hiredis``); with ``memory`` nothing here exists and
nothing costs. ``Fleet`` owns the replica's ``SharedState`` and joins it to
the proxy's parts:

- **the board** (``FleetBoard``): one of the board's listeners; every
  record the board applies that was made here (its ``origin`` None) is
  published: readiness changes, checks, inventories and good engine reads,
  each through the one codec (``core/fleet_records.py``). The other
  replicas' records and the join's snapshot are decoded with their origin
  and applied through the board's same verb, ``apply``; their origin is
  what keeps them from being told again. A remote engine reading is
  judged again once it is three intervals old (``age_engines``), so it
  goes stale here even on a replica that reads no engine itself.
- **the slots** (``FleetSlots``): an attempt that has its local slot takes
  the node's lease in Redis (``Attempts``' fleet step); when Redis says the
  node is full, the node counts as full in the local ledger
  (``SlotLedger.elsewhere``) and the workload waits in the local queue
  until a freed slot is announced (or the oldest lease may have lapsed).
  A freed slot of another replica also comes off the engine's last
  reading of the node (``SlotLedger.ended_elsewhere``): that reading
  counted the other replica's attempt, and the next one is a load
  interval away. An attempt that ends while nobody else wants its slot
  keeps its lease for the node's next one (``spare_leases.py``), so steady
  traffic through one replica asks Redis nothing per request; a workload
  that waits here for a node full by the engine's count asks for it on
  the ``wanted`` channel (``FleetSlots.queued``), as a refused take does.
- **cache affinity** (``FleetAffinity``, ``shared_affinity.py``): the
  chains this replica's nodes served go out as ``served`` records, and
  the others' come into the proxy's memory of them.
- **usage** (``FleetUsage``, ``shared_usage.py``): each finished request's
  tokens and slot-seconds are added up in Redis, so ``GET /usage`` at any
  replica shows the fleet's.

Its own tasks run in the proxy's nursery (``Fleet.run``): the shared
state's membership, the publisher (the board's listeners are synchronous;
records go out through a channel), and the slots' renewer and marks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import trio

from ...core import fleet_records
from ...core.affinity import Served
from ...core.config import Config
from ...core.engine_book import EngineChange
from ...core.engine_state import EngineRead
from ...core.fleet_records import RemoteRecord
from ...core.fleet_share import ShareSummary
from ...core.node_change import InventoryChange, LastCheck, NodeChange
from ...core.redis_url import parse_state
from ...telemetry.logs import logger
from ..nodes.affinity import CacheAffinity
from ..nodes.board import BoardRecord, NodeBoard
from ..nodes.queue import SlotQueue
from .fair_share import SHARE, FleetFairShare
from .shared_affinity import SERVED, FleetAffinity
from .shared_state import SharedState
from .shared_usage import FleetUsage
from .spare_leases import SpareLease, SpareLeases

__all__ = ["Fleet", "FleetBoard", "FleetSlots"]

OUTBOX = 10_000  # records waiting to go out; more while Redis is slow are dropped
REFUSED_RETRY_MOST = 5.0  # seconds a node counts as full elsewhere without news
ALONE_RETRY = 1.0  # likewise, over this replica's share while Redis is away
EXPIRED = "expired"  # the reason of the board's expiry changes
STALE_MARGIN = 0.001  # a reading is stale once strictly older than three intervals


class FleetBoard:
    """The node board's news out to the other replicas, and theirs in."""

    def __init__(self, board: NodeBoard, state: SharedState) -> None:
        self.board = board
        self.state = state
        self._send, self._outbox = trio.open_memory_channel[tuple[dict[str, Any], str]](OUTBOX)
        # node -> when the last remote engine read folded was taken (this clock).
        self._engine_reads: dict[str, float] = {}
        self._engine_news = trio.Event()
        board.listen(self.told)

    # -- out -----------------------------------------------------------------

    def told(self, record: BoardRecord) -> None:
        """The board's listener: publish a record made here (``origin`` None).

        Not an expiry: every replica's ticker sees its cooldowns run out, and
        a late "expired" could erase a cooldown another replica began since.
        Of an engine's reads only the good ones: a failed one is this
        replica's own news (its path to the engine); the last good reading
        goes stale on every replica on its own.
        """
        if isinstance(record, EngineChange):
            read = record.read
            if read is None or read.signals.last_error:
                return
            shared: NodeChange | InventoryChange | LastCheck | EngineRead = read
        elif isinstance(record, NodeChange) and record.reason == EXPIRED:
            return
        else:
            shared = record
        if shared.origin is None:
            self._queue(fleet_records.encode(shared, trio.current_time()), shared.node)

    def _queue(self, record: dict[str, Any], node: str) -> None:
        try:
            self._send.send_nowait((record, node))
        except trio.WouldBlock:
            logger.debug("shared state: a record was dropped", extra={"fields": {"node": node}})

    async def publish_all(self) -> None:
        """Send the records as they come (its own task, for the proxy's lifetime)."""
        async for record, node in self._outbox:
            await self.state.publish(record, node=node)

    # -- in ------------------------------------------------------------------

    def on_record(self, remote: RemoteRecord) -> None:
        """Apply one record of another replica (``SharedState``'s ``on_record``)."""
        if remote.node not in self.board.nodes:
            return
        now = trio.current_time()
        record = fleet_records.decode(remote, now)
        if record is None or isinstance(record, Served | ShareSummary):  # not the board's
            return
        self.board.apply(record, now)
        if isinstance(record, EngineRead):
            self._watch_engine(record, now)

    def on_snapshot(self, records: list[RemoteRecord]) -> None:
        """Apply a join's snapshot, oldest record first."""
        for record in fleet_records.snapshot_order(records):
            self.on_record(record)

    def _watch_engine(self, read: EngineRead, now: float) -> None:
        """Watch a folded remote read's age (the newest reading wins: ``next_state``)."""
        # A late, older read changed nothing: the newer one's age still counts.
        taken = max(read.at, self._engine_reads.get(read.node, -math.inf))
        self._engine_reads[read.node] = taken
        self._engine_news.set()

    async def age_engines(self) -> None:
        """Judge each remote reading again once it is stale, so that it leaves the signals.

        The book drops a stale reading at the node's next read, and a
        replica that reads no engine itself (or cannot reach it) has none.
        """
        while True:
            now, max_age = trio.current_time(), self.board.engines.settings.max_age
            for node, at in list(self._engine_reads.items()):
                if now - at > max_age:
                    del self._engine_reads[node]
                    self.board.judge_engine(node, now)
            self._engine_news = trio.Event()
            first = min(self._engine_reads.values(), default=math.inf)
            with trio.move_on_at(first + max_age + STALE_MARGIN):
                await self._engine_news.wait()


class FleetSlots:
    """The slot leases of this replica's attempts (``Attempts``' fleet step)."""

    def __init__(self, state: SharedState, queue: SlotQueue) -> None:
        self.state = state
        self.queue = queue
        self.ledger = queue.scheduler.ledger
        # lease id -> (node, the lease), renewed by ``renew_all``
        self.held: dict[str, tuple[str, SpareLease]] = {}
        self._until: dict[str, float] = {}  # node -> when its "full elsewhere" mark ends
        self._marked = trio.Event()
        self._frees: dict[str, int] = {}  # node -> freed announcements heard
        self.spares = SpareLeases(state)  # ended attempts' leases, kept for the next
        # Fair share across replicas (``fair_share.py``); None: each replica alone.
        self.fair: FleetFairShare | None = None

    async def take(self, node: str) -> str | None:
        """The node's lease for an attempt holding its local slot; None: full across the fleet.

        The node's spare when this replica kept one (``spare_leases.py``:
        Redis is not asked), else one round trip, bounded by
        ``--state-timeout``. Without an answer (Redis away) the replica
        decides alone, within its share.
        """
        capacity = self.ledger.capacity(node)
        if capacity <= 0:  # no limit: nothing to share
            return ""
        # While Redis is away the replica decides alone, within its share.
        spare = await self.spares.use(node, capacity) if self.state.connected else None
        if spare is None:
            spare = await self._take(node, capacity)
            if spare is None:
                return None
        self.held[spare.lease] = (node, spare)
        return spare.lease

    async def _take(self, node: str, capacity: int) -> SpareLease | None:
        """The round trip; None: full across the fleet (or over this replica's share)."""
        lease = self.state.new_lease_id()
        frees = self._frees.get(node, 0)
        try:
            taken = await self.state.take_slot(node, lease, capacity)
        except BaseException:  # cancelled: the take may have happened in Redis
            await self.state.release_slot(node, lease, capacity=capacity, seen_full=False)
            raise
        now = trio.current_time()
        if taken is None:  # away, or no answer in time: this replica's share
            if self.ledger.in_flight(node) > self.state.share(capacity):
                self._mark(node, ALONE_RETRY)
                return None
            return SpareLease(lease, False, now)  # Redis may not hold it: never kept
        if not taken.taken:
            # A slot freed while the answer came (on the other connection):
            # no mark, the workload asks again at once.
            if self._frees.get(node, 0) == frees:
                self._mark(node, min(REFUSED_RETRY_MOST, max(0.05, taken.retry_after)))
            return None
        return SpareLease(lease, True, now)

    async def release(self, node: str, lease: str) -> None:
        """End the attempt's lease: kept as the node's spare, or written and not waited for.

        Called before the local slot goes back, so ``is_full`` still counts
        this attempt: a node full here (by an engine's count too) keeps no
        spare, and has its freed slot announced to the other replicas.
        """
        if not lease:
            return
        entry = self.held.pop(lease, None)
        capacity = self.ledger.capacity(node)
        crowded = self.ledger.full_by_others(node)
        # A client waiting at another replica deserves it more: the slot is
        # given back and announced, and this replica's waiters leave it to
        # that one for --state-timeout (``fair_share.py``).
        deferred = self.fair is not None and self.fair.defer()
        if (
            deferred
            or entry is None
            or not self.spares.keep(node, entry[1], capacity, crowded=crowded)
        ):
            full = self.ledger.is_full(node)
            if deferred:
                self._mark(node, self.state.state_timeout)
            await self.state.release_slot(
                node, lease, capacity=capacity, seen_full=full or deferred
            )
        if not deferred:
            self.freed(node)  # this replica's waiters: no announcement comes back for them

    async def queued(self, nodes: Iterable[str]) -> None:
        """A workload waits here for ``nodes``: ask for those the engine's count fills.

        A waiter for a node this replica sees full by the engine's count
        asks Redis nothing (it runs when a freed slot is announced, or at
        the engine's next reading), so a spare kept elsewhere would stand
        in its way unheard: it is asked for on the ``wanted`` channel.
        A node full by a refused take was told there by the take itself.
        """
        for node in nodes:
            if self.ledger.full_by_others(node):
                await self.state.want_slot(node)

    def wanted(self, node: str) -> None:
        """A workload somewhere waits for ``node`` (the ``wanted`` channel)."""
        if node in self.ledger.nodes:
            self.spares.wanted(node)

    def announced(self, node: str, mine: bool) -> None:
        """A freed slot at ``node`` was announced (``on_freed``).

        This replica's own release was dealt with when it was made. Another
        replica's ended an attempt that the engine's last reading still
        counts as busy: the ledger takes it off (``SlotLedger.ended_elsewhere``),
        so a waiter here runs now, not at the engine's next reading, a load
        interval later.
        """
        if mine:
            return
        if self.ledger.ended_elsewhere(node):
            self.queue.dispatch()  # the node may have room now, by the engine's count
        self.freed(node)

    def freed(self, node: str) -> None:
        """A slot at ``node`` was freed somewhere (``on_freed``): let a waiter try again."""
        self._frees[node] = self._frees.get(node, 0) + 1
        if node in self.ledger.elsewhere:
            self.ledger.elsewhere.discard(node)
            self._until.pop(node, None)
            self.queue.dispatch()

    def _mark(self, node: str, retry_after: float) -> None:
        self.ledger.elsewhere.add(node)
        self._until[node] = trio.current_time() + retry_after
        self._marked.set()

    async def watch_marks(self) -> None:
        """End each "full elsewhere" mark at its time (a holder may have died: ask again)."""
        while True:
            now = trio.current_time()
            for node in [node for node, until in self._until.items() if until <= now]:
                self.freed(node)
            self._marked = trio.Event()
            with trio.move_on_at(min(self._until.values(), default=math.inf)):
                await self._marked.wait()

    async def watch_state(self) -> None:
        """A join or a loss of Redis changes who decides: every mark ends, waiters try again.

        At a join, every running attempt's lease is taken again, with no
        limit: one taken while Redis was away never was, and a restarted
        Redis kept none; taking a held lease again only renews it. So the
        other replicas count those attempts from the join on. The same at a
        lapse of this replica's heartbeat: another replica may have judged
        it dead and freed its leases.
        """
        joins = (self.state.joins, self.state.lapses)
        while True:
            await self.state.wait_changed()
            # A kept lease may have gone with Redis (a restart saves nothing).
            await self.spares.give_back_all()
            if self.state.connected and (self.state.joins, self.state.lapses) != joins:
                joins = (self.state.joins, self.state.lapses)
                for lease, (node, _) in list(self.held.items()):
                    if lease in self.held:
                        await self.state.take_slot(node, lease, 0)
            for node in list(self._until):
                self.freed(node)

    async def renew_all(self) -> None:
        """Renew every held lease each third of ``--lease-ttl`` (one task for all attempts)."""
        while True:
            await trio.sleep(self.state.lease_ttl / 3)
            for lease, (node, _) in list(self.held.items()):
                if lease in self.held:
                    await self.state.renew_slot(node, lease)


class Fleet:
    """The replica's shared state joined to its board and slot queue."""

    def __init__(
        self,
        config: Config,
        board: NodeBoard,
        queue: SlotQueue,
        affinity: CacheAffinity | None = None,
    ) -> None:
        address = parse_state(config.state)
        assert address is not None, "Fleet needs --state redis://..."
        self.board_link: FleetBoard | None = None
        self.state = SharedState(
            address,
            [node.name for node in config.upstreams],
            prefix=config.state_prefix,
            lease_ttl=config.lease_ttl,
            state_timeout=config.state_timeout,
            lease_nodes=lambda: queue.scheduler.ledger.nodes,
            on_record=self._on_record,
            on_freed=self._on_freed,
            on_wanted=self._on_wanted,
            on_snapshot=self._on_snapshot,
        )
        self.board_link = FleetBoard(board, self.state)
        self.slots = FleetSlots(self.state, queue)
        self.fair = self.slots.fair = FleetFairShare(queue, self.state)
        # Cache affinity's served records (``shared_affinity.py``); None: affinity not shared.
        self.affinity_link: FleetAffinity | None = None
        if affinity is not None:
            self.affinity_link = FleetAffinity(affinity, self.state, board.nodes)
        self.usage = FleetUsage(self.state)  # the report tells it (``Report.share_usage``)

    def _on_record(self, record: RemoteRecord) -> None:
        if record.record.get("kind") == SHARE:
            self.fair.on_record(record)
        elif record.record.get("kind") == SERVED:
            if self.affinity_link is not None:
                self.affinity_link.on_record(record)
        elif self.board_link is not None:
            self.board_link.on_record(record)

    def _on_snapshot(self, records: list[RemoteRecord]) -> None:
        served = [record for record in records if record.record.get("kind") == SERVED]
        if self.affinity_link is not None:
            for record in served:
                self.affinity_link.on_record(record)
        if self.board_link is not None:
            self.board_link.on_snapshot([r for r in records if r.record.get("kind") != SERVED])

    def _on_freed(self, node: str, mine: bool) -> None:
        self.slots.announced(node, mine)

    def _on_wanted(self, node: str) -> None:
        self.slots.wanted(node)

    def status(self) -> dict[str, Any]:
        """``/status``'s ``state``."""
        return self.state.status()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join (or try once), then keep the fleet's tasks running until cancelled."""
        async with trio.open_nursery() as nursery:
            assert self.board_link is not None
            nursery.start_soon(self.board_link.publish_all)
            if self.affinity_link is not None:
                nursery.start_soon(self.affinity_link.publish_all)
            nursery.start_soon(self.board_link.age_engines)
            nursery.start_soon(self.fair.publish_all)
            nursery.start_soon(self.usage.publish_all)
            await nursery.start(self.state.run)
            nursery.start_soon(self.slots.watch_marks)
            nursery.start_soon(self.slots.watch_state)
            nursery.start_soon(self.slots.renew_all)
            nursery.start_soon(self.slots.spares.give_back_unused)
            task_status.started()
