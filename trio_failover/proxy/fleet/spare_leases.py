"""Spare slot leases: an ended attempt's lease kept for the node's next attempt.

With ``--state redis://`` an attempt that ends while nobody else wants its
slot keeps its lease as the node's *spare* (one per node and replica), and
the next attempt there uses it, asking Redis nothing. When one is kept and
when it is given back (wanted elsewhere, the engine full of others' work,
``SPARE_HOLD``, ``RECYCLE_MOST``, an outage or a reload) is told in
docs/replicas.md ("Spare leases").
"""

from __future__ import annotations

import math

import attrs
import trio

from .shared_state import SharedState

__all__ = ["RECYCLE_MOST", "SpareLease", "SpareLeases"]

SPARE_HOLD = 0.05  # seconds a spare waits for the node's next attempt
RECYCLE_MOST = 10.0  # seconds after its take a lease may still be kept


@attrs.frozen
class SpareLease:
    """A lease held in Redis, with what its take said.

    Attributes:
        lease: the lease id.
        in_redis: Redis said it was taken; False when it was taken alone
            while Redis was away (never kept: Redis may not hold it).
        taken: when it was taken (Trio time).
    """

    lease: str
    in_redis: bool
    taken: float


@attrs.define(eq=False)
class _Kept:
    spare: SpareLease
    capacity: int
    kept: float


class SpareLeases:
    """This replica's spare lease at each node (at most one each)."""

    def __init__(self, state: SharedState) -> None:
        self.state = state
        self.hold = SPARE_HOLD  # seconds a spare waits (tests lengthen it)
        self._kept: dict[str, _Kept] = {}
        self._wanted_at: dict[str, float] = {}  # node -> when it was last wanted
        # The give-back task sleeps on this while no spare is kept; else it
        # wakes every hold, so keeping one costs no wake-up of its own.
        self._first = trio.Event()
        self._idle = False
        self._wanted_now = trio.Event()

    async def use(self, node: str, capacity: int) -> SpareLease | None:
        """The node's spare, for the attempt about to run (it is no longer kept); None: none.

        One kept under another capacity (a reload changed it since) is
        given back instead: the room it was judged by is gone.
        """
        kept = self._kept.pop(node, None)
        if kept is None:
            return None
        if kept.capacity != capacity:
            await self._give_back(node, kept)
            return None
        return kept.spare

    async def give_back_all(self) -> None:
        """Give back every spare (Redis was lost or joined again: a lease may be gone with it)."""
        kept, self._kept = self._kept, {}
        for node, spare in kept.items():
            await self._give_back(node, spare)

    def keep(self, node: str, spare: SpareLease, capacity: int, *, crowded: bool) -> bool:
        """Keep an ended attempt's lease as the node's spare if nobody else wants it; False: don't.

        ``crowded``: this replica sees the engine's count fill the node with
        work besides its own (``SlotLedger.full_by_others``).
        """
        now = trio.current_time()
        if (
            crowded
            or node in self._kept
            or not spare.in_redis
            or self._wanted_at.get(node, -math.inf) >= spare.taken
            or now - spare.taken >= min(RECYCLE_MOST, self.state.lease_ttl / 3 - self.hold)
        ):
            return False
        self._kept[node] = _Kept(spare, capacity, now)
        if self._idle:
            self._first.set()
        return True

    def wanted(self, node: str) -> None:
        """A workload waits for ``node`` (the ``wanted`` channel): its spare goes back now.

        A lease held there now, taken before this, is not kept at its end.
        Only the configured nodes' news is kept (``FleetSlots.wanted``).
        """
        self._wanted_at[node] = trio.current_time()
        if node in self._kept:
            self._wanted_now.set()

    async def give_back_unused(self) -> None:
        """Give back each spare unused for ``SPARE_HOLD``, or wanted elsewhere (its own task).

        A spare goes back one to two holds after it was kept. At the task's
        end (the proxy stops) every spare left is given back.
        """
        try:
            while True:
                if not self._kept:
                    self._idle, self._first = True, trio.Event()
                    await self._first.wait()
                    self._idle = False
                with trio.move_on_after(self.hold):
                    await self._wanted_now.wait()
                self._wanted_now = trio.Event()
                now = trio.current_time()
                for node, kept in list(self._kept.items()):
                    wanted = self._wanted_at.get(node, -math.inf) >= kept.kept
                    if wanted or kept.kept + self.hold <= now:
                        del self._kept[node]
                        await self._give_back(node, kept)
        finally:
            with trio.CancelScope(shield=True):
                await self.give_back_all()

    async def _give_back(self, node: str, kept: _Kept) -> None:
        lease, capacity = kept.spare.lease, kept.capacity
        await self.state.release_slot(node, lease, capacity=capacity, seen_full=False)
