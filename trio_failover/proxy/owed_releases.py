"""The slot releases one replica posts, and those it owes to its next join.

A release is written and not waited for (``SlotLeases.release``). One that
could not be written (Redis away, or the write did not go out within
``--state-timeout``), or whose answer never came, is owed: a take that
timed out may have happened in Redis, and a lease taken there must end.
At the next join every owed release is sent (``settle``); past
``OWED_MOST`` they are left to end by their TTL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio

from ..core.errors import StateError
from ..telemetry.logs import logger
from ..wire.slot_lease import SlotLeases

__all__ = ["OWED_MOST", "Link", "OwedReleases"]

OWED_MOST = 10_000  # releases kept for the next join; past that they end by their TTL


class Link(Protocol):
    """What a release needs of the joined connection (``SharedState``'s link)."""

    @property
    def leases(self) -> SlotLeases: ...


class OwedReleases:
    """The posted releases of one replica, and those owed to its next join."""

    def __init__(
        self, link: Callable[[], Link | None], replica_id: str, state_timeout: float
    ) -> None:
        self.link = link  # the joined connection's verbs now; None while away
        self.replica_id = replica_id
        self.state_timeout = state_timeout
        # lease id -> (node, capacity): releases Redis may not have heard.
        self.owed: dict[str, tuple[str, int]] = {}

    async def post(self, node: str, lease_id: str, capacity: int, seen_full: bool) -> bool:
        """``SharedState.release_slot``: posted, or owed when it cannot be."""
        link = self.link()

        def answered(answer: bool | StateError) -> None:
            if isinstance(answer, StateError):
                logger.debug(
                    "shared state: a release failed", extra={"fields": {"error": str(answer)}}
                )
                self.owe(node, lease_id, capacity)

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
        self.owe(node, lease_id, capacity)
        return False

    def owe(self, node: str, lease_id: str, capacity: int) -> None:
        if len(self.owed) < OWED_MOST:
            self.owed[lease_id] = (node, capacity)

    async def settle(self) -> None:
        """At a join: send the releases Redis may not have heard."""
        owed, self.owed = self.owed, {}
        for lease_id, (node, capacity) in owed.items():
            await self.post(node, lease_id, capacity, seen_full=False)
