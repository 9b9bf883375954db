"""Fair share across replicas: waiting clients told, a freed slot left to the fairest.

With ``--state redis://…`` every replica keeps its own queue, and a slot it
frees used to go to its own best waiter, which reaches Redis first. Here
each replica publishes a ``share`` record (``core/fleet_share.ShareSummary``:
per priority and client, its waiting workloads, running attempts and use;
per node, its attempts in flight, which the others' ``least-loaded`` and
``/status`` add to their own)
when it changes, at most every ``PERIOD`` seconds and again every
``REFRESH`` seconds while it names anyone, from a task of its own (never on
the request path). The others' latest records make the mirror; one older
than ``STALE`` seconds (a replica that died or lost Redis) counts for
nothing.

When an attempt here ends, ``defer`` asks ``fleet_share.defer_to_fleet``
whether a client waiting at another replica is strictly more deserving,
fleet-wide, than this replica's best waiter; if so, ``FleetSlots.release``
gives the lease back, announced, and marks the node full here for
``--state-timeout``, so that the other replica's waiter takes it; if nobody
did by then, this replica's waiters try again. The same summaries carry
each client's running attempts and use: those at the other replicas join
its own here (``SlotScheduler.told_elsewhere``), toward its
``max_in_flight`` and in the order of this replica's own queue, so a client
that floods through several replicas is behind, in each, a client that
used the fleet less. While Redis is away nothing is deferred and nothing
counted: each replica decides alone, as without replicas.
"""

from __future__ import annotations

import trio

from ...core import fleet_records
from ...core.fleet_records import RemoteRecord
from ...core.fleet_share import (
    ClientShare,
    ShareSummary,
    defer_to_fleet,
    fleet_standing,
    in_flight_by_replicas,
    told_by_replicas,
)
from ..nodes.queue import SlotQueue
from .shared_state import SharedState

SHARE = "share"  # the record's kind
PERIOD = 0.1  # seconds between two looks at this replica's queue
REFRESH = 1.0  # a summary that names anyone is told again this often
STALE = 3.0  # another replica's summary older than this counts for nothing


class FleetFairShare:
    """This replica's waiting clients out, the others' in, and the deferral rule between."""

    def __init__(self, queue: SlotQueue, state: SharedState) -> None:
        self.queue = queue
        self.scheduler = queue.scheduler
        self.state = state
        # replica id -> (its latest summary, when it came, on this clock)
        self.remote: dict[str, tuple[ShareSummary, float]] = {}
        self.deferred = 0  # freed slots left to another replica's client (for tests, /status)

    def on_record(self, remote: RemoteRecord) -> None:
        """Keep another replica's latest ``share`` record."""
        now = trio.current_time()
        record = fleet_records.decode(remote, now)
        if isinstance(record, ShareSummary):
            self.remote[remote.origin] = (record, now)
            self.count_elsewhere(now)

    def count_elsewhere(self, now: float) -> None:
        """Each client's attempts and use at the other replicas, joined to its own here.

        From the current summaries, each dated when it came (none while
        Redis is away: each replica alone): toward its ``max_in_flight``
        and in the fair order of this replica's queue. A count that fell
        may let a waiter at its limit run.
        """
        heard: list[tuple[ShareSummary, float]] = []
        if self.state.connected:
            heard = [(summary, at) for summary, at in self.remote.values() if now - at <= STALE]
        ledger = self.scheduler.ledger
        ledger.in_flight_elsewhere = {
            node: count
            for node, count in in_flight_by_replicas(summary for summary, _ in heard).items()
            if node in ledger.nodes
        }
        if self.scheduler.told_elsewhere(told_by_replicas(heard), now):
            self.queue.dispatch()

    def fresh(self, now: float) -> list[ShareSummary]:
        """The other replicas' summaries still current at ``now``."""
        return [summary for summary, at in self.remote.values() if now - at <= STALE]

    def defer(self) -> bool:
        """Whether a slot freed here now should be left to another replica's client."""
        if not self.state.connected or not self.scheduler.fair:
            return False
        now = trio.current_time()
        remote = self.fresh(now)
        if not remote:
            return False
        scheduler = self.scheduler
        local = {
            client: (running, use) for client, _, _, running, use in scheduler.share_summary(now)
        }
        clients = set(local) | {share.client for summary in remote for share in summary.clients}
        standing = fleet_standing(
            local, remote, {client: scheduler.shares.settings_of(client) for client in clients}
        )
        if defer_to_fleet(scheduler.best_waiting(now), remote, standing):
            self.deferred += 1
            return True
        return False

    async def publish_all(self) -> None:
        """Tell this replica's summary when it changes (its own task, for the proxy's lifetime)."""
        told: tuple[tuple[object, ...], ...] | None = None
        told_at = -REFRESH
        while True:
            await trio.sleep(PERIOD)
            now = trio.current_time()
            self.count_elsewhere(now)  # a summary gone stale, or Redis gone, counts no more
            clients = tuple(ClientShare(*entry) for entry in self.scheduler.share_summary(now))
            ledger = self.scheduler.ledger
            in_flight = {node: n for node in ledger.nodes if (n := ledger.in_flight(node))}
            shape = (
                tuple((c.client, c.rank, c.waiting, c.running) for c in clients),
                tuple(in_flight.items()),
            )
            if shape == told and (not any(shape) or now - told_at < REFRESH):
                continue
            record = fleet_records.encode(ShareSummary(clients, in_flight=in_flight), now)
            if await self.state.publish(record):
                told, told_at = shape, now
