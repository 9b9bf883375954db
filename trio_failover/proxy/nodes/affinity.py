"""Cache affinity in the shell: the memory of what each node served, its counts.

``core/affinity.py`` decides (a request's chain, its matches, the node it
prefers); this module holds the proxy's one ``AffinityMemory`` and carries
the decisions out: ``choose`` asks the slot ledger for each candidate's
load when a request is planned, ``served`` remembers the chain under the
node that answered and counts the hit or miss (``/status``, metrics, the
access line). Another replica's serves come in as ``Served`` records,
with their origin, through ``apply``; this proxy's own go out through
``share`` (set by the fleet with ``--state redis://``), which must not
block: it queues the record for a task of the fleet's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ...core.affinity import (
    NO_MATCH,
    AffinityMemory,
    Candidate,
    Chain,
    Matches,
    Served,
    digest_text,
    prefer,
    prompt_chain,
)

if TYPE_CHECKING:
    from ...core.config import Upstream
    from ...telemetry.metrics import Metrics
    from ..records import Workload
    from .queue import SlotQueue


@attrs.define
class AffinityCounts:
    """One node's served requests with affinity on: ``/status``'s ``affinity``."""

    hits: int = 0
    misses: int = 0
    matched_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        """The ``/status`` form."""
        return {"hits": self.hits, "misses": self.misses, "matched_bytes": self.matched_bytes}


@attrs.frozen
class Affine:
    """A request's chain and what the memory matched of it when it was planned."""

    chain: Chain
    matches: Matches
    preferred: str | None


class CacheAffinity:
    """The proxy's memory of served chains, and the counts of what matched."""

    def __init__(self, metrics: Metrics | None = None, memory: AffinityMemory | None = None):
        self.memory = memory if memory is not None else AffinityMemory()
        self.counts: dict[str, AffinityCounts] = {}
        self.metrics = metrics
        # The replicas' feed (``--state redis://``): queues the record for
        # the fleet's publisher; never blocks the request path.
        self.share: Callable[[Served], None] | None = None

    def choose(
        self, document: Any, candidates: Sequence[Upstream], queue: SlotQueue
    ) -> Affine | None:
        """The request's chain, its matches, and the node it prefers (None: no prompt).

        The prompt is hashed here once, whatever the number of candidates.
        """
        chain = prompt_chain(document)
        if chain is None:
            return None
        matches = self.memory.match(chain) if candidates else NO_MATCH
        if not matches.blocks:
            return Affine(chain, matches, None)
        ledger = queue.scheduler.ledger
        is_ready = queue.is_ready
        seen = [
            Candidate(  # name, ready, full, load, in_flight, capacity
                node.name,
                is_ready(node.name),
                ledger.is_full(node.name),
                ledger.load(node.name),
                ledger.in_flight(node.name),
                ledger.capacity(node.name),
            )
            for node in candidates
        ]
        return Affine(chain, matches, prefer(matches, seen))

    def served(self, work: Workload, node: str, affine: Affine) -> None:
        """``node`` answered the request: remember its chain there, count the match."""
        blocks = affine.matches.blocks.get(node, 0)
        matched = affine.chain.matched_bytes(blocks)
        counts = self.counts.get(node) or self.counts.setdefault(node, AffinityCounts())
        if blocks:
            counts.hits += 1
            counts.matched_bytes += matched
        else:
            counts.misses += 1
        work.cache_matched(matched)
        if self.metrics is not None:
            self.metrics.affinity_served(node, blocks > 0, matched)
        self.memory.remember(node, affine.chain.hashes)
        if self.share is not None:
            self.share(Served(node, tuple(map(digest_text, affine.chain.hashes))))

    def apply(self, record: Served) -> bool:
        """Another replica's serve (its ``origin`` set): its node holds that chain now.

        Returns False for a record whose chain is not one of ours (dropped).
        """
        hashes = record.hashes()
        if hashes is None:
            return False
        self.memory.remember(record.node, hashes)
        return True

    def status(self, node: str) -> dict[str, int]:
        """``/status``'s ``affinity`` of ``node``."""
        counts = self.counts.get(node)
        return counts.to_json() if counts is not None else AffinityCounts().to_json()
