"""The slot scheduler's hand-off, first come first served against fair share.

    .venv/bin/python scripts/bench_scheduler.py        # or: bench.py --only scheduler

A freed slot is handed to one of 1,000 waiting workloads of 50 clients
(one in five of them may use only the other node, so a hand-off must skip
some), and a new workload takes the waiter's place, so the queue stays
1,000 long. What is timed is the release that hands the slot on
(``SlotScheduler.release``: the decision and its bookkeeping), in µs per
hand-off, the best of several rounds, for ``fair=False`` (first come, first
served) and ``fair=True`` (priority, then the client with the least use ÷
weight, then arrival). Pure Python, no I/O: the figures depend on the CPU
alone, and the ratio of the two is what to compare.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from trio_failover.core.slots import Granted, Queued, Slot, SlotScheduler

WAITERS = 1000
CLIENTS = 50
HANDOFFS = 5000
ROUNDS = 7
READY = frozenset({"a", "b"})


def one_round(fair: bool) -> float:
    """Seconds per hand-off over ``HANDOFFS`` of them."""
    scheduler: SlotScheduler[int] = SlotScheduler({"a": 2, "b": 2}, fair=fair)
    slots: list[Slot] = []
    now = 0.0
    for token in range(4):
        result = scheduler.acquire(token, ("a", "b"), ready=READY, client=f"c{token}", now=now)
        assert isinstance(result, Granted)
        slots.append(result.slot)
    arrivals = 4

    def arrive() -> None:
        nonlocal arrivals
        order = ("b",) if arrivals % 5 == 0 else ("a", "b")
        result = scheduler.acquire(
            arrivals, order, ready=READY, client=f"c{arrivals % CLIENTS}", now=now
        )
        assert isinstance(result, Queued)
        arrivals += 1

    for _ in range(WAITERS):
        arrive()
    spent = 0.0
    clock: Callable[[], float] = time.perf_counter
    for _ in range(HANDOFFS):
        now += 0.25
        slot = slots.pop(0)
        started = clock()
        [handoff] = scheduler.release(slot, ready=READY, now=now)
        spent += clock() - started
        slots.append(handoff.slot)
        arrive()
    return spent / HANDOFFS


def measure() -> dict[str, float]:
    """µs per hand-off, best of ``ROUNDS``, FIFO and fair.

    The rounds alternate, so that a change of the machine's load falls on both.
    """
    best = {"fifo": float("inf"), "fair": float("inf")}
    for _ in range(ROUNDS):
        for name, fair in (("fifo", False), ("fair", True)):
            best[name] = min(best[name], one_round(fair) * 1e6)
    return best


def lines() -> list[str]:
    figures = measure()
    return [
        f"Scheduler hand-off: {WAITERS} waiting workloads of {CLIENTS} clients, "
        f"best of {ROUNDS} rounds of {HANDOFFS}",
        f"  first come, first served (--fair-share off): {figures['fifo']:6.2f} µs per hand-off",
        f"  fair share (--fair-share on):                {figures['fair']:6.2f} µs per hand-off",
        f"  fair / fifo: {figures['fair'] / figures['fifo']:.2f}",
    ]


def main() -> int:
    for line in lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
