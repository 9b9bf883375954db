"""Pure: fair share across replicas: each replica's waiting clients, and who a freed slot is for.

With ``--state redis://…`` every replica keeps its own queue, and a slot
it frees would go to its own best waiter, which reaches Redis first. So
each replica tells the others a ``ShareSummary``: per priority and client,
its waiting workloads, its running attempts and its recent use. A
client's fleet-wide standing is the sum over the replicas
(``fleet_standing``); when a slot frees here, ``defer_to_fleet`` says
whether a client waiting at another replica is strictly more deserving
than this replica's best waiter: then this replica lets the announced
slot go to the other replica for a short grace before taking it itself.
The same figures, heard at a known time (``told_by_replicas``), join each
client's own in this replica's book (``sharing.ShareBook.told_elsewhere``),
so that this replica's own queue is ordered by fleet-wide use too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

__all__ = [
    "ClientShare",
    "ShareSummary",
    "Standing",
    "defer_to_fleet",
    "fleet_standing",
    "in_flight_by_replicas",
    "told_by_replicas",
]


@attrs.frozen
class ClientShare:
    """One client at one replica.

    Attributes:
        client: its name.
        rank: the priority rank of its waiting workloads (0 = high).
        waiting: its workloads waiting there, of that rank.
        running: its attempts holding a slot there.
        use: its decayed slot-seconds there when written (running ones included).
    """

    client: str
    rank: int
    waiting: int
    running: int
    use: float


@attrs.frozen
class ShareSummary:
    """One replica's clients that wait or run (``core/fleet_records.py``'s ``share`` kind).

    ``in_flight``: that replica's attempts holding a slot, per node (the
    nodes with none left out): the other replicas add them to their own
    (``least-loaded``, ``/status``). ``node`` is always None (a replica's
    record, not a node's); ``origin`` the replica that wrote it (None: this one).
    """

    clients: tuple[ClientShare, ...]
    node: str | None = None
    origin: str | None = None
    in_flight: Mapping[str, int] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class Standing:
    """A client's fleet-wide standing: its attempts running and its use, summed over replicas."""

    running: int = 0
    use: float = 0.0
    weight: float = 1.0
    max_in_flight: int = 0

    def at_limit(self) -> bool:
        """Whether its ``max_in_flight`` is reached fleet-wide."""
        return 0 < self.max_in_flight <= self.running


def fleet_standing(
    local: Mapping[str, tuple[int, float]],
    remote: Iterable[ShareSummary],
    settings: Mapping[str, tuple[float, int]],
) -> dict[str, Standing]:
    """Every client's standing: this replica's ``(running, use)`` plus the others' summaries.

    ``settings``: client -> ``(weight, max_in_flight)``; others get ``(1, 0)``.
    A client named twice in one summary (two priorities) counts once.
    """
    sums: dict[str, tuple[int, float]] = dict(local)
    for summary in remote:
        seen: set[str] = set()
        for share in summary.clients:
            if share.client in seen:
                continue
            seen.add(share.client)
            running, use = sums.get(share.client, (0, 0.0))
            sums[share.client] = (running + share.running, use + share.use)
    return {
        client: Standing(running, use, *settings.get(client, (1.0, 0)))
        for client, (running, use) in sums.items()
    }


def in_flight_by_replicas(summaries: Iterable[ShareSummary]) -> dict[str, int]:
    """Each node's attempts at the replicas of ``summaries``, summed."""
    counts: dict[str, int] = {}
    for summary in summaries:
        for node, count in summary.in_flight.items():
            counts[node] = counts.get(node, 0) + count
    return counts


def told_by_replicas(
    heard: Iterable[tuple[ShareSummary, float]],
) -> list[tuple[float, str, int, float]]:
    """``(heard_at, client, running, use)`` once per summary and client, for ``ShareBook``.

    ``heard``: the other replicas' current summaries, each with the time it
    came. A client named twice in one summary (two priorities) counts once.
    """
    told: list[tuple[float, str, int, float]] = []
    for summary, at in heard:
        seen: set[str] = set()
        for share in summary.clients:
            if share.client not in seen:
                seen.add(share.client)
                told.append((at, share.client, share.running, share.use))
    return told


def _key(rank: int, standing: Standing) -> tuple[int, bool, float]:
    """Smaller goes first: priority, then nothing running, then use ÷ weight."""
    return (rank, standing.running > 0, standing.use / standing.weight)


def defer_to_fleet(
    local_best: tuple[int, str] | None,
    remote: Iterable[ShareSummary],
    standing: Mapping[str, Standing],
) -> bool:
    """Whether a slot freed here should go to a client waiting at another replica.

    Args:
        local_best: ``(rank, client)`` of this replica's best waiter; None: none waits.
        remote: the other replicas' latest summaries.
        standing: every client's fleet-wide standing (``fleet_standing``).

    Returns:
        True when some other replica has a waiting client, not this one's
        and not at its fleet-wide ``max_in_flight``, that is strictly more
        deserving: a higher priority; or the same and nothing running
        fleet-wide against something; or that and a lower use ÷ weight.
    """
    if local_best is None:
        return False
    rank, client = local_best
    mine = _key(rank, standing.get(client, Standing()))
    for summary in remote:
        for share in summary.clients:
            if not share.waiting or share.client == client:
                continue
            theirs = standing.get(share.client, Standing())
            if not theirs.at_limit() and _key(share.rank, theirs) < mine:
                return True
    return False
