"""The clients of a shared fleet in the request path: their priority and rate limits.

Which client a request is comes from the gate (``proxy.ClientGate``: the
key's name, else ``--client-header``, else ``anonymous``). Here the
client's ``[[client]]`` table gives the request its priority (lowered by
``X-Priority: low``) and its ``rpm``/``tpm`` limits, decided by
``core/limits.py``; fair share and ``max_in_flight`` are the slot
scheduler's (``core/slots.py``, fed by ``nodes/queue.py``). See
docs/sharing.md.

With ``--state redis://`` (``fleet``) the windows are the fleet's, in
Redis (``core/rate_layout.py``), one round trip bounded by
``--state-timeout`` for a client with a limit; while Redis is away each
replica counts alone, within its share of each limit.
"""

from __future__ import annotations

from typing import Protocol

from ...core.client_key import ClientKey
from ...core.config import LiveConfig
from ...core.headers import get
from ...core.limits import RateBook
from ...core.sharing import NORMAL, priority_rank, request_priority
from ...core.state_layout import share_of
from ..records import Workload


class FleetRates(Protocol):
    """The shared state's client windows (``SharedState``); None with ``--state memory``."""

    replicas: int

    def new_lease_id(self) -> str: ...

    async def admit_client(
        self, client: str, request_id: str, rpm: int, tpm: int
    ) -> int | None: ...

    async def charge_client(self, client: str, answer_id: str, tokens: int) -> bool: ...


# Forget empty windows of clients (a header names any number of them) this often.
FORGET_EVERY = 1024


class ClientShares:
    """Each client's table, by name, and its windows of requests and tokens."""

    def __init__(self, live: LiveConfig) -> None:
        self._live = live
        # The clients' tables by name, made again when a reload brings new ones.
        self._seen: tuple[ClientKey, ...] | None = None
        self._tables: dict[str, ClientKey] = {}
        self.rates = RateBook()
        self._admitted = 0
        self.fleet: FleetRates | None = None  # set by the proxy with a shared state

    def table(self, name: str) -> ClientKey | None:
        """The ``[[client]]`` (or ``--api-key``) settings of ``name``; None: defaults."""
        clients = self._live.config.clients
        if clients is not self._seen:  # a reload: the tables read again, once
            self._tables = {client.name: client for client in clients}
            self._seen = clients
        return self._tables.get(name)

    def rank(self, name: str, headers: list[tuple[bytes, bytes]]) -> int:
        """The request's priority rank: its client's, lowered by ``X-Priority: low``."""
        table = self.table(name)
        rank = NORMAL if table is None else priority_rank(table.priority)
        return request_priority(rank, get(headers, b"x-priority"))

    def admit(self, name: str, now: float) -> int | None:
        """Count a request of ``name`` at ``now``; or the ``Retry-After`` of its ``429``."""
        table = self.table(name)
        if table is None or not (table.rpm or table.tpm):
            return None
        self._admitted += 1
        if self._admitted % FORGET_EVERY == 0:
            self.rates.forget(now)
        return self.rates.admit(name, now, table.rpm, table.tpm)

    async def admit_fleet(self, name: str, now: float) -> int | None:
        """``admit`` across the replicas: in Redis, else within this replica's share.

        Cancellation: a request cancelled while Redis answers may have been counted.
        """
        table = self.table(name)
        fleet = self.fleet
        if fleet is None or table is None or not (table.rpm or table.tpm):
            return self.admit(name, now)
        answer = await fleet.admit_client(name, fleet.new_lease_id(), table.rpm, table.tpm)
        if answer is not None:
            return answer or None
        replicas = fleet.replicas
        return self.rates.admit(
            name, now, share_of(table.rpm, replicas), share_of(table.tpm, replicas)
        )

    def charge(self, work: Workload, now: float) -> None:
        """The answer of ``work`` ended at ``now``: its tokens count for its client's ``tpm``."""
        table = self.table(work.client)
        if table is None or not table.tpm:
            return
        tokens = (work.prompt_tokens or 0) + (work.completion_tokens or 0)
        self.rates.charge(work.client, now, tokens)

    async def charge_fleet(self, work: Workload, now: float) -> None:
        """``charge`` across the replicas: in Redis, else in this replica's own window."""
        table = self.table(work.client)
        fleet = self.fleet
        if fleet is None or table is None or not table.tpm:
            self.charge(work, now)
            return
        tokens = (work.prompt_tokens or 0) + (work.completion_tokens or 0)
        if tokens > 0 and not await fleet.charge_client(work.client, fleet.new_lease_id(), tokens):
            self.rates.charge(work.client, now, tokens)
