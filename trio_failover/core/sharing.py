"""Pure: who a workload's client is, its priority, and each client's recent use.

A fleet is shared by people and programs (docs/sharing.md). When a slot
frees, the slot scheduler (``slots.SlotScheduler``) gives it to the waiting
workload of the highest priority, then of the client whose recent use of
the fleet divided by its weight is lowest, then the longest-waiting. This
module keeps the numbers that decision reads and names the clients.

*Use* is slot-seconds: the time a client's attempts held slots, running
ones included, decaying with a half-life of one minute. It is kept without
a timer and without touching every client at each decision: every amount is
stored multiplied by ``2 ** ((t - epoch) / HALF_LIFE)``, the factor of the
instant it was earned, so all clients' stored sums share one factor and
compare as they are. An attempt held from ``s`` to ``e`` earns
``∫ 2**((t - epoch)/H) dt = C * (E(e) - E(s))`` with ``C = H / ln 2``: its
take subtracts ``C * E(s)`` and counts it running, its release adds
``C * E(e)``; while it runs, ``running * C * E(now)`` completes the sum. The
epoch moves forward (every stored sum scaled down once) before the factor
grows past ``2 ** 30``, so nothing overflows however long the proxy runs.

With replicas (``--state redis://``) each client's use and running
attempts at the other replicas are kept beside its own, in the same units
(``ShareBook.told_elsewhere``): a use ``u`` with ``n`` attempts running,
heard at ``t``, is stored as ``(u - n * C) * E(t)``, so that with
``n * C * E(now)`` added it is ``u`` decayed from ``t`` plus what the
``n`` attempts earned since, exactly as a local running attempt's term
completes the local sum. The fair pick adds the two: use is fleet-wide.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal, NamedTuple

__all__ = [
    "ANONYMOUS",
    "HALF_LIFE",
    "NORMAL",
    "PRIORITIES",
    "ClientUse",
    "Priority",
    "ShareBook",
    "client_from_header",
    "priority_rank",
    "request_priority",
]

Priority = Literal["high", "normal", "low"]
# Highest first: a priority's rank is its index (0 = served first).
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
NORMAL = PRIORITIES.index("normal")
ANONYMOUS = "anonymous"
"""The client of a workload that names none (no key, no client header)."""

HALF_LIFE = 60.0
"""Seconds after which a slot-second of use counts half."""
_C = HALF_LIFE / math.log(2)
# Move the epoch once the factor passes 2**30 (30 half-lives, half an hour):
# far below a float's range, and precise enough (a sum's 53 bits keep 23).
_REBASE_AFTER = 30 * HALF_LIFE
# A client with nothing running and less use than this (slot-seconds) is
# forgotten by ``forget``: names from a client header must not pile up.
_FORGOTTEN_BELOW = 1e-3

# What a client header may name: what a person's name, id or e-mail address
# needs (Open WebUI forwards those), and nothing a log line or a metrics
# label would have to escape.
_HEADER_NAME = re.compile(rb"[A-Za-z0-9._:@-]{1,128}")


def client_from_header(value: bytes | None) -> str | None:
    """The client that a ``--client-header`` value names; None when the value is invalid.

    No header, or an empty one, names ``anonymous``; 1-128 characters of
    ``[A-Za-z0-9._:@-]`` name themselves; any other value is a bad request.
    """
    if not value:
        return ANONYMOUS
    if _HEADER_NAME.fullmatch(value) is None:
        return None
    return value.decode("ascii")


def priority_rank(priority: str) -> int:
    """The rank of a configured priority (0 = highest).

    Raises:
        ValueError: not one of ``PRIORITIES``.
    """
    return PRIORITIES.index(priority)  # type: ignore[arg-type,unused-ignore]


def request_priority(rank: int, header: bytes | None) -> int:
    """A request's rank: its client's, lowered to ``low`` by ``X-Priority: low``.

    A request may only lower its own priority, never raise it; any other
    value of the header is ignored.
    """
    if header is not None and header.strip().lower() == b"low":
        return len(PRIORITIES) - 1
    return rank


class Elsewhere(NamedTuple):
    """What ``ShareBook.told_elsewhere`` changed."""

    changed: set[str]
    """The clients whose figures at the other replicas changed."""
    fell: bool
    """A running count of a client with a ``max_in_flight`` fell: a waiter may run."""


@dataclass(slots=True)
class ClientUse:
    """One client's share settings and its use, in the book's scaled units.

    Attributes:
        weight: its share of a full fleet, relative to the others' (> 0).
        max_in_flight: most attempts running at once; 0 = no limit.
        scaled: the stored sum (see the module's docstring); with
            ``running`` and the factor of now it makes the use of now.
        running: its attempts holding a slot now.
        elsewhere: its attempts running at the other replicas, as they
            last told (``--state redis://``; 0 without): they count toward
            ``max_in_flight`` and, with ``scaled_elsewhere``, toward its
            fleet-wide use; a client running only there is not idle here.
        scaled_elsewhere: its use at the other replicas, in the same units
            as ``scaled`` and completed the same way by ``elsewhere``'s
            running term (the module's docstring); 0 without replicas.
    """

    weight: float = 1.0
    max_in_flight: int = 0
    scaled: float = 0.0
    running: int = 0
    elsewhere: int = 0
    scaled_elsewhere: float = 0.0

    def at_limit(self) -> bool:
        """Whether it may start no further attempt now (``max_in_flight``, fleet-wide)."""
        return 0 < self.max_in_flight <= self.running + self.elsewhere


class ShareBook:
    """Every client's decaying use and its settings; changed only at take and release."""

    def __init__(self, settings: Mapping[str, tuple[float, int]] | None = None) -> None:
        """An empty book.

        Args:
            settings: client name -> ``(weight, max_in_flight)``; others get ``(1, 0)``.
        """
        self.epoch: float | None = None
        self.clients: dict[str, ClientUse] = {}
        self._settings: dict[str, tuple[float, int]] = dict(settings or {})

    def configure(self, settings: Mapping[str, tuple[float, int]]) -> None:
        """A reload's client settings: their use is kept, their weight and limit change."""
        self._settings = dict(settings)
        for name, use in self.clients.items():
            use.weight, use.max_in_flight = self._settings.get(name, (1.0, 0))

    def settings_of(self, name: str) -> tuple[float, int]:
        """``name``'s configured ``(weight, max_in_flight)``; ``(1, 0)`` when not configured."""
        return self._settings.get(name, (1.0, 0))

    def client(self, name: str) -> ClientUse:
        """The record of ``name``, made on first sight."""
        use = self.clients.get(name)
        if use is None:
            weight, limit = self._settings.get(name, (1.0, 0))
            use = self.clients[name] = ClientUse(weight, limit)
        return use

    def at_limit(self, name: str) -> bool:
        """Whether ``name`` runs ``max_in_flight`` attempts already."""
        use = self.clients.get(name)
        if use is None:
            return False
        return use.at_limit()

    def told_elsewhere(
        self, told: Iterable[tuple[float, str, int, float]], now: float
    ) -> Elsewhere:
        """The other replicas' figures replace the last ones (absent: none).

        Args:
            told: ``(heard_at, client, running, use)``, once per replica and
                client: its attempts running there and its use there when
                heard (running ones included), ``heard_at`` no later than
                ``now`` (``fleet_share.told_by_replicas``). The same figures
                heard at the same instant store the same sums, to the bit.
            now: the time of this call.

        Returns:
            The clients whose figures changed, and whether the running count
            of one with a ``max_in_flight`` fell (a waiter at its limit may run).
        """
        self.factor(now)  # sets the epoch, or moves it
        epoch = self.epoch
        assert epoch is not None
        sums: dict[str, tuple[int, float]] = {}
        heard_at, factor = math.nan, 1.0
        for at, name, running, used in told:
            if at != heard_at:  # one power per summary, not per client
                heard_at, factor = at, 2.0 ** ((at - epoch) / HALF_LIFE)
            count, scaled = sums.get(name, (0, 0.0))
            # Heard at ``at``: ``used`` decays from there; the ``running``
            # term (added when read) completes it with what they earned since.
            earned = (used - running * _C) * factor
            sums[name] = (count + running, scaled + earned)
        changed: set[str] = set()
        fell = False
        for name, use in self.clients.items():
            count, scaled = sums.pop(name, (0, 0.0))
            if count != use.elsewhere or scaled != use.scaled_elsewhere:
                changed.add(name)
                if count < use.elsewhere and use.max_in_flight:
                    fell = True
                use.elsewhere, use.scaled_elsewhere = count, scaled
        for name, (count, scaled) in sums.items():
            if count or scaled:
                use = self.client(name)
                use.elsewhere, use.scaled_elsewhere = count, scaled
                changed.add(name)
        return Elsewhere(changed, fell)

    def scale(self, factor: float) -> float:
        """What one running attempt adds to a stored sum at ``factor``.

        A client's use at that factor, in the stored sums' units, is
        ``scaled + running * scale(factor)``: what the fair pick compares,
        divided by the weight.
        """
        return _C * factor

    def forget(self, now: float, keep: AbstractSet[str]) -> None:
        """Drop the records of idle clients whose use is negligible at ``now``, but ``keep``'s.

        A record may be held elsewhere (the scheduler's queue keeps those of
        the clients that wait): those are kept, so it stays the one record.
        """
        factor = self.factor(now)
        for name, use in list(self.clients.items()):
            if (
                not use.running
                and not use.elsewhere
                and not use.scaled_elsewhere
                and use.scaled < _FORGOTTEN_BELOW * factor
                and name not in keep
            ):
                del self.clients[name]

    def factor(self, now: float) -> float:
        """``2 ** ((now - epoch) / HALF_LIFE)``, moving the epoch first when it is far behind."""
        epoch = self.epoch
        if epoch is None:
            self.epoch = epoch = now
        elif now - epoch > _REBASE_AFTER:
            self._rebase(now)
            epoch = now
        return 2.0 ** ((now - epoch) / HALF_LIFE) if now > epoch else 1.0

    def took(self, name: str, now: float) -> None:
        """An attempt of ``name`` took a slot at ``now``."""
        factor = self.factor(now)
        use = self.client(name)
        use.scaled -= _C * factor
        use.running += 1

    def took_use(self, use: ClientUse, now: float) -> None:
        """``took`` for the record in hand (the scheduler's queue keeps its waiters' records)."""
        use.scaled -= _C * self.factor(now)
        use.running += 1

    def released(self, name: str, now: float) -> None:
        """An attempt of ``name`` gave its slot back at ``now``."""
        factor = self.factor(now)
        use = self.client(name)
        use.scaled += _C * factor
        use.running -= 1

    def use(self, name: str, now: float) -> float:
        """``name``'s recent use at ``now``: decayed slot-seconds, running attempts included."""
        factor = self.factor(now)
        use = self.clients.get(name)
        if use is None:
            return 0.0
        return max(use.scaled + use.running * _C * factor, 0.0) / factor

    def fleet_use(self, name: str, now: float) -> float:
        """``name``'s use at ``now`` here and at the other replicas: what its turn depends on."""
        factor = self.factor(now)
        use = self.clients.get(name)
        if use is None:
            return 0.0
        running = use.running + use.elsewhere
        return max(use.scaled + use.scaled_elsewhere + running * _C * factor, 0.0) / factor

    def _rebase(self, now: float) -> None:
        assert self.epoch is not None
        scale = 2.0 ** (-(now - self.epoch) / HALF_LIFE)
        for use in self.clients.values():
            use.scaled *= scale  # the running attempts' own terms too
            use.scaled_elsewhere *= scale
        self.epoch = now
