"""The replicas' shared state in Redis (docs/replicas.md): one ``SharedState`` per replica.

It owns two connections (``wire/redis.py``): one for commands, shared by
every task, and one subscription that receives the other replicas' change
records and the freed-slot announcements. What it offers:

- ``publish(record, node=...)``: tell the other replicas a change (and
  store it in the node's hash, which a replica loads when it (re)joins);
- ``take_slot`` / ``renew_slot`` / ``release_slot``: the slot lease
  (``wire/slot_lease.py``'s scripts) with ``--lease-ttl`` (``fleet.py``
  renews every held lease from one task); the release is written and not
  waited for, so the take is the request path's one round trip; one that
  could not be written, or whose answer never came, is owed to the next
  join (below);
- callbacks, all synchronous and called from its own task:
  ``on_record(RemoteRecord)`` for each record of another replica,
  ``on_freed(node, mine)`` for each freed slot announced (``mine``: by this
  replica's own release), ``on_wanted(node)`` for each take refused at a
  node (any replica's), ``on_snapshot(records)`` once per join;
- ``status()``, the ``/status`` document's ``state``; ``replicas``, the live
  count it last saw; ``share(capacity)``, its share while Redis is away;
  ``lapses``, how often it found its own heartbeat expired while joined
  (another replica may have freed its leases: ``fleet.py`` takes its
  running attempts' leases again, as at a join).

Bounds: every call on a request's path waits at most ``--state-timeout``
and never raises a ``StateError``: it returns None when Redis did not
answer, and at once while Redis is away (the caller goes on with its local
state and its share of the capacity). ``run`` is the lifetime: it joins,
keeps the heartbeat, listens, notices Redis going away (a lost connection,
or a heartbeat or request-path call that timed out and a probe that then
timed out too), logs that once, and rejoins by itself with a bounded
backoff (``core/state_layout.rejoin_delay``).

The heartbeat, every second: the replica's beat lasts three, and each
beat reads every member of the replicas' set. A member whose beat expired
while this replica watched (``state_layout.judge``) died, or lost Redis:
its slot leases are freed at once, announced, in one script
(``SlotLeases.reap``), so its slots are free within five seconds of its
last beat rather than one ``--lease-ttl`` (30 s by default).

Owed releases: a release that could not be written (Redis away, or the
write did not go out within ``--state-timeout``), or whose answer never
came, is owed: a take that timed out may have happened in Redis, and a
lease taken there must end. At the next join every owed release is sent;
past ``OWED_MOST`` they are left to end by their TTL.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import trio

from ...core import fleet_records, state_layout
from ...core.errors import StateError, StateReplyError
from ...core.fleet_records import RemoteRecord
from ...core.redis_url import RedisAddress
from ...core.state_layout import Beats, LeaseTake, freed_channel, read_freed, wanted_channel
from ...core.usage_book import Counts, Pair
from ...telemetry.logs import logger
from ...wire.client_rates import ClientRates
from ...wire.redis import RedisConnection, Subscription, open_redis, open_subscription
from ...wire.slot_lease import SharedRecords, SlotLeases

__all__ = ["RemoteRecord", "SharedState"]

T = TypeVar("T")

HEARTBEAT_MOST = 1.0  # seconds between heartbeats, at most; a beat lasts three
OWED_MOST = 10_000  # releases kept for the next join; past that they end by their TTL
USAGE_READ_TIMEOUT = 2.0  # seconds GET /usage waits for the fleet's counts


def _ignore(*_: object) -> None:
    return None


@attrs.frozen
class _Link:
    """The joined connection and the verbs over it."""

    connection: RedisConnection
    leases: SlotLeases
    records: SharedRecords


class SharedState:
    """One replica's link to the shared state; ``await nursery.start(state.run)`` to join.

    Args:
        address: the Redis (``core.redis_url.parse_state``).
        nodes: the configured nodes' names (whose hashes a join loads).
        prefix: ``--state-prefix``.
        lease_ttl: ``--lease-ttl``, seconds.
        state_timeout: ``--state-timeout``, seconds: the bound of each call
            on a request's path, and of each connect.
        replica_id: this replica's id (default: a random one).
        heartbeat_interval: seconds between heartbeats (default: a third of
            ``lease_ttl``, at most 1 s); a replica counts as live for three.
        ssl_context: for ``rediss://`` (default: the system's).
        lease_nodes: the nodes whose leases a dead replica may hold, now
            (default: ``nodes``; the proxy's follow a reload).
        on_record, on_freed, on_wanted, on_snapshot: the callbacks (module docstring).
    """

    def __init__(
        self,
        address: RedisAddress,
        nodes: Sequence[str],
        *,
        prefix: str = "trio-failover:",
        lease_ttl: float = 30.0,
        state_timeout: float = 0.25,
        replica_id: str | None = None,
        heartbeat_interval: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
        lease_nodes: Callable[[], Sequence[str]] | None = None,
        on_record: Callable[[RemoteRecord], None] = _ignore,
        on_freed: Callable[[str, bool], None] = _ignore,
        on_wanted: Callable[[str], None] = _ignore,
        on_snapshot: Callable[[list[RemoteRecord]], None] = _ignore,
    ) -> None:
        self.address = address
        self.nodes = tuple(nodes)
        self.prefix = prefix
        self.lease_ttl = lease_ttl
        self.state_timeout = state_timeout
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.heartbeat_interval = heartbeat_interval or min(lease_ttl / 3, HEARTBEAT_MOST)
        self.ssl_context = ssl_context
        self.lease_nodes = lease_nodes or (lambda: self.nodes)
        self.on_record, self.on_freed, self.on_snapshot = on_record, on_freed, on_snapshot
        self.on_wanted = on_wanted
        self.replicas = 1
        """Live replicas (this one included) as last seen; kept while Redis is away."""
        self.joins = 0
        """How many times this replica has joined (1 after the first)."""
        self.lapses = 0
        """How many times, while joined, it found its own heartbeat expired."""
        self.channels = (
            state_layout.records_channel(prefix),
            freed_channel(prefix),
            wanted_channel(prefix),
        )
        self._link: _Link | None = None
        self._probe = trio.Event()
        self._changed = trio.Event()
        self._lease_ids = itertools.count(1)
        # lease id -> (node, capacity): releases Redis may not have heard.
        self._owed: dict[str, tuple[str, int]] = {}
        self._outage: str | None = "not joined yet"
        self.since_ms = 0
        """When this replica began to watch the others' beats (its join, or
        its own last lapse), by Redis' clock: it judges only what expired since."""

    # -- what the proxy reads ------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether Redis is reachable now (False while going on alone)."""
        return self._link is not None

    def status(self) -> dict[str, Any]:
        """``/status``'s ``state``: ``{"backend", "connected", "replicas"}``."""
        return {"backend": "redis", "connected": self.connected, "replicas": self.replicas}

    def share(self, capacity: int) -> int:
        """This replica's share of ``capacity`` while Redis is away (at least 1; 0 stays 0)."""
        return state_layout.share_of(capacity, self.replicas)

    async def wait_changed(self) -> None:
        """Return at the next join, loss of Redis or change of ``replicas``."""
        await self._changed.wait()

    # -- the request path: each call bounded by --state-timeout --------------------------

    def new_lease_id(self) -> str:
        """A lease id unique to one attempt: this replica's id and a counter."""
        return f"{self.replica_id}:{next(self._lease_ids)}"

    async def publish(self, record: Mapping[str, Any], *, node: str | None = None) -> bool:
        """Tell the other replicas ``record``; with ``node``, also store it in the node's hash.

        The hash keeps the latest record of each field (``record_field``:
        the kind, and ``record["key"]`` when there is one), which is what a
        joining replica loads.

        Returns:
            True once Redis has it; False while Redis is away or when it did
            not answer within ``--state-timeout``.

        Raises:
            ValueError: ``record`` has no string ``"kind"`` or is not JSON.
        """
        envelope = fleet_records.encode_envelope(self.replica_id, node, record)
        field = fleet_records.record_field(record)

        async def publish(link: _Link, deadline: float) -> bool:
            await link.records.publish(envelope, node, field, deadline=deadline)
            return True

        return await self._bounded(publish) is not None

    async def take_slot(self, node: str, lease_id: str, capacity: int) -> LeaseTake | None:
        """Take a slot at ``node`` fleet-wide (``SlotLeases.take``), or None when Redis is away.

        None means "decide locally": take the slot in the local ledger
        within ``share(capacity)``. A take that timed out may still have
        happened in Redis: release ``lease_id`` anyway when the attempt ends.
        """
        ttl = self.lease_ttl
        return await self._bounded(
            lambda link, deadline: link.leases.take(
                node, lease_id, capacity=capacity, ttl=ttl, deadline=deadline
            )
        )

    async def renew_slot(self, node: str, lease_id: str) -> bool | None:
        """Extend the lease by ``--lease-ttl``: True, False (it had expired), None (Redis away)."""
        ttl = self.lease_ttl
        return await self._bounded(
            lambda link, deadline: link.leases.renew(node, lease_id, ttl=ttl, deadline=deadline)
        )

    async def release_slot(
        self, node: str, lease_id: str, *, capacity: int, seen_full: bool
    ) -> bool:
        """End the lease, without waiting for Redis' answer: True once it is written.

        Announced when a waiter may hope for the slot (``SlotLeases.release``).
        False while Redis is away or the write did not go out within
        ``--state-timeout``: then, and when its answer never came, it is
        owed to the next join (a take that timed out may have happened).
        Shielded (see ``RedisConnection.post``).
        """
        link = self._link

        def answered(answer: bool | StateError) -> None:
            if isinstance(answer, StateError):
                logger.debug(
                    "shared state: a release failed", extra={"fields": {"error": str(answer)}}
                )
                self._owe(node, lease_id, capacity)

        if link is not None and await link.leases.release(
            node,
            lease_id,
            capacity=capacity,
            seen_full=seen_full,
            origin=self.replica_id,
            deadline=trio.current_time() + self.state_timeout,
            on_answer=answered,
        ):
            return True
        self._owe(node, lease_id, capacity)
        return False

    def _owe(self, node: str, lease_id: str, capacity: int) -> None:
        if len(self._owed) < OWED_MOST:
            self._owed[lease_id] = (node, capacity)

    async def want_slot(self, node: str) -> bool:
        """Tell the other replicas that a workload here waits for ``node`` (``SlotLeases.want``).

        Posted, not waited for; False while Redis is away (a spare is then
        nobody's: nothing to ask for).
        """
        link = self._link
        if link is None:
            return False
        return await link.leases.want(node, deadline=trio.current_time() + self.state_timeout)

    async def admit_client(self, client: str, request_id: str, rpm: int, tpm: int) -> int | None:
        """Count a request of ``client`` fleet-wide (``ClientRates.admit``).

        Returns:
            0 admitted, else the ``Retry-After`` seconds; None while Redis is
            away or silent past ``--state-timeout`` (decide alone, then).
        """
        prefix = self.prefix
        return await self._bounded(
            lambda link, deadline: ClientRates(link.connection, prefix).admit(
                client, request_id, rpm=rpm, tpm=tpm, deadline=deadline
            )
        )

    async def charge_client(self, client: str, answer_id: str, tokens: int) -> bool:
        """Count ``tokens`` of ``client``'s ended answer fleet-wide; False when not written."""
        prefix = self.prefix

        async def charge(link: _Link, deadline: float) -> bool:
            await ClientRates(link.connection, prefix).charge(
                client, answer_id, tokens, deadline=deadline
            )
            return True

        return await self._bounded(charge) is not None

    async def add_usage(
        self, batch_id: str, batch: Mapping[Pair, tuple[str | None, Counts]]
    ) -> bool:
        """Count finished requests' usage fleet-wide (``ClientRates.add_usage``).

        Returns False when it was not written (or its answer did not come).

        A batch sent again with its id after a False counts once.
        """
        prefix = self.prefix

        async def add(link: _Link, deadline: float) -> bool:
            await ClientRates(link.connection, prefix).add_usage(batch_id, batch, deadline=deadline)
            return True

        return await self._bounded(add) is not None

    async def read_usage(self) -> dict[Pair, tuple[str | None, Counts, Counts]] | None:
        """The fleet's usage (``ClientRates.read_usage``); None while Redis is away or silent.

        Not on a request's path: it may take ``USAGE_READ_TIMEOUT`` (or
        ``--state-timeout`` when longer).
        """
        prefix = self.prefix
        return await self._bounded(
            lambda link, deadline: ClientRates(link.connection, prefix).read_usage(
                deadline=deadline
            ),
            bound=max(self.state_timeout, USAGE_READ_TIMEOUT),
        )

    async def _bounded(
        self, call: Callable[[_Link, float], Awaitable[T]], bound: float | None = None
    ) -> T | None:
        """``call`` within ``bound`` seconds (``--state-timeout``); None: away, or it failed."""
        link = self._link
        if link is None:
            await trio.lowlevel.checkpoint()
            return None
        try:
            return await call(link, trio.current_time() + (bound or self.state_timeout))
        except StateError as exc:
            # The heartbeat probes Redis now, and a probe that fails too is an
            # outage: one slow answer on a busy host is not, while a lost
            # connection fails the probe at once and a silent Redis by its deadline.
            logger.debug("shared state: a call failed", extra={"fields": {"error": str(exc)}})
            self._probe.set()
            return None

    # -- the lifetime: join, heartbeat, listen, notice a loss, rejoin ------------------------
    # ``beat`` is the heartbeat of a joined replica (its own task); the tests
    # drive it under a mock clock with stand-ins for the two connections' verbs.

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join, stay joined, rejoin after every loss, until cancelled; never raises a StateError.

        ``task_status.started()`` comes after the first try to join, joined
        or not: the proxy serves either way (alone until Redis answers).
        Cancellation: leaves the replicas' set when it can within
        ``--state-timeout`` and closes both connections.
        """
        failures = 0
        while True:
            try:
                connection, subscription = await self._join()
            except StateError as exc:
                failures += 1
                self._went_down(str(exc))
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                await trio.sleep(state_layout.rejoin_delay(failures))
                continue
            failures = 0
            task_status.started()
            task_status = trio.TASK_STATUS_IGNORED
            reason = await self._stay_joined(connection, subscription)
            self._went_down(reason)
            await trio.sleep(state_layout.rejoin_delay(1))

    async def _join(self) -> tuple[RedisConnection, Subscription]:
        """Connect both, count the replicas, load the snapshot; all or nothing."""
        deadline = trio.current_time() + self.state_timeout
        subscription = await open_subscription(
            self.address, self.channels, deadline=deadline, ssl_context=self.ssl_context
        )
        try:
            connection = await open_redis(
                self.address,
                deadline=deadline,
                ssl_context=self.ssl_context,
                client_name=f"trio-failover:{self.replica_id}",
            )
            try:
                # Subscribed first: a record told meanwhile waits in the socket
                # and is applied after the snapshot, which it is newer than.
                records = SharedRecords(connection, self.prefix)
                beats = await self._heartbeat(records)
                self.since_ms = beats.now_ms
                snapshot = await records.snapshot(self.nodes, deadline=deadline)
            except BaseException:
                await connection.aclose()
                raise
        except BaseException:
            await subscription.aclose()
            raise
        self.on_snapshot([record for record in snapshot if record.origin != self.replica_id])
        return connection, subscription

    async def _stay_joined(self, connection: RedisConnection, subscription: Subscription) -> str:
        """Serve the joined state until Redis is lost; returns why."""
        records = SharedRecords(connection, self.prefix)
        self.joins += 1
        self._joined(_Link(connection, SlotLeases(connection, self.prefix), records))
        await self._settle_owed()
        self._outage = None
        message = "shared state: rejoined" if self.joins > 1 else "shared state: joined"
        logger.log(
            logging.WARNING if self.joins > 1 else logging.INFO,
            message,
            extra={"fields": self._fields()},
        )
        reason: str | None = None
        try:
            async with trio.open_nursery() as nursery:

                async def watch(check: Callable[[], Awaitable[None]]) -> None:
                    nonlocal reason
                    try:
                        await check()
                    except StateError as exc:
                        reason = str(exc)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch, lambda: self._listen(subscription))
                nursery.start_soon(
                    watch, lambda: self.beat(records, SlotLeases(connection, self.prefix))
                )
        finally:
            self._joined(None)
            if reason is None and connection.closed_reason is None:
                # Cancelled (the proxy stops): leave the live count at once
                # rather than one heartbeat TTL later, if Redis answers.
                with trio.move_on_after(self.state_timeout, shield=True):
                    deadline = trio.current_time() + self.state_timeout
                    with contextlib.suppress(StateError):
                        await records.heartbeat(self.replica_id, 0, deadline=deadline)
            try:
                await connection.aclose()
            finally:  # a cancelled close still closes, then raises Cancelled
                await subscription.aclose()
        return reason or "the connection ended"

    async def _settle_owed(self) -> None:
        """At a join: send the releases Redis may not have heard."""
        owed, self._owed = self._owed, {}
        for lease_id, (node, capacity) in owed.items():
            await self.release_slot(node, lease_id, capacity=capacity, seen_full=False)

    async def _listen(self, subscription: Subscription) -> None:
        """Hand each message to its callback; raises StateUnavailable when the connection goes."""
        records, freed, wanted = (channel.encode() for channel in self.channels)
        async for message in subscription:
            if message.channel == freed:
                node, origin = read_freed(message.data.decode(errors="replace"))
                self.on_freed(node, origin == self.replica_id)
            elif message.channel == wanted:
                self.on_wanted(message.data.decode(errors="replace"))
            elif message.channel == records:
                record = fleet_records.decode_envelope(message.data)
                if record is not None and record.origin != self.replica_id:
                    self.on_record(record)
        raise StateError("subscription", "ended")

    async def beat(self, records: SharedRecords, leases: SlotLeases) -> None:
        """The heartbeat, every interval, or at once when a call asks for a probe; until cancelled.

        After each beat: a lapse of its own is told (``lapses``), and the
        replicas that stopped beating are reaped.

        Raises:
            StateError: a beat failed (Redis is lost: ``run`` rejoins).
        """
        while True:
            with trio.move_on_after(self.heartbeat_interval):
                await self._probe.wait()
            self._probe = trio.Event()  # fresh for the next failed call
            before = self.replicas
            beats = await self._heartbeat(records)
            if beats.lapsed:
                # Another replica may have judged this one dead and freed its
                # leases: they are taken again, and what expired meanwhile is
                # not this replica's to judge.
                self.since_ms = beats.now_ms
                logger.warning(
                    "shared state: this replica's heartbeat had expired: "
                    "its running attempts' slots are taken again",
                    extra={"fields": self._fields()},
                )
                self._lapsed()
            if self.replicas != before:
                logger.info(
                    "shared state: live replicas",
                    extra={"fields": {**self._fields(), "before": before}},
                )
            lease_ttl_ms = state_layout.lease_ms(self.lease_ttl)
            verdict = state_layout.judge(beats, self.replica_id, self.since_ms, lease_ttl_ms)
            if verdict:
                await self._reap(leases, verdict)

    async def _heartbeat(self, records: SharedRecords) -> Beats:
        deadline = trio.current_time() + self._beat_timeout()
        ttl = 3 * self.heartbeat_interval
        beats = await records.heartbeat(self.replica_id, ttl, deadline=deadline)
        self._counted(max(1, beats.live))
        return beats

    def _beat_timeout(self) -> float:
        # Off the request path: a little more room than a request gets, so
        # that one slow answer on a busy host is not an outage.
        return max(self.state_timeout, min(1.0, self.heartbeat_interval))

    async def _reap(self, leases: SlotLeases, verdict: state_layout.Verdict) -> None:
        """Free the dead replicas' leases and drop them (and the forgotten) from the set.

        Two round trips: the leases held at the nodes, then one script that
        frees those of the dead and announces each (``SlotLeases.reap``).
        Several replicas may judge the same death: the first script drops
        it, the others find it gone and free nothing.
        """
        deadline = trio.current_time() + self._beat_timeout()
        freed: Mapping[str, Sequence[str]] = {}
        if verdict.dead:
            holders = await leases.holders(self.lease_nodes(), deadline=deadline)
            freed = state_layout.leases_to_free(verdict.dead, holders)
        try:
            dropped = await leases.reap(
                (*verdict.dead, *verdict.forgotten), freed, deadline=deadline
            )
        except StateReplyError as exc:  # not an outage: the next beat tries again
            logger.debug("shared state: a reap failed", extra={"fields": {"error": str(exc)}})
            return
        for replica in verdict.dead:
            if replica in dropped:
                logger.warning(
                    "shared state: a replica stopped beating: its slots are freed",
                    extra={
                        "fields": {
                            **self._fields(),
                            "dead": replica,
                            "freed": dropped[replica],
                        }
                    },
                )

    def _went_down(self, reason: str) -> None:
        """Redis is away: say it once per outage (and at the first failed join)."""
        if self._outage is None or self._outage == "not joined yet":
            logger.warning(
                "shared state unreachable: going on alone with this replica's share "
                "of each capacity until it is back",
                extra={"fields": {**self._fields(), "error": reason}},
            )
        self._outage = reason

    def _fields(self) -> dict[str, Any]:
        return {
            "state": self.address.display(),
            "replica": self.replica_id,
            "replicas": self.replicas,
        }

    def _joined(self, link: _Link | None) -> None:
        self._link = link
        self._tell_changed()

    def _counted(self, replicas: int) -> None:
        if replicas != self.replicas:
            self.replicas = replicas
            self._tell_changed()

    def _lapsed(self) -> None:
        self.lapses += 1
        self._tell_changed()

    def _tell_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
