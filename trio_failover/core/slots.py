"""Pure: node capacity, the queue of waiting workloads, and load-aware order.

Decide first, then act. Every call here decides synchronously from plain
data (node names, counts, an answer to "is this node ready?") and changes
only this module's own tables; the Trio shell acts afterwards: it opens the
connection of a granted slot and sets the event of each woken waiter. Nothing
here reads a clock, blocks or imports outside the standard library.

Two rules hold throughout:

1. A ready untried candidate always beats a cooling or down one, even when it
   is full (the workload then waits for it). Only when every untried
   candidate is cooling or down are those used, in their resolved order.
2. A slot is taken in the ledger at the moment it is decided, for a newcomer
   as for a woken waiter, so no two workloads are ever handed the same slot;
   a freed slot that some waiter may use is handed on in the same call that
   frees it, so a newcomer never finds a free slot a waiter was owed.

One ``SlotScheduler`` per proxy; what the shell does with it, per workload::

    tried: set[str] = set()
    budget = QueueBudget(queue_timeout)
    while True:
        order = [...]          # candidate names, see choose_node()
        result = scheduler.acquire(trio.Event(), order, tried=tried,
                                   ready=is_ready, preferred=preferred)
        if isinstance(result, Exhausted): ...      # all tried: 502/504 as today
        if isinstance(result, QueueFull): ...      # 503 queue_full at once
        if isinstance(result, Queued):
            waiter, started = result.waiter, trio.current_time()
            try:
                with trio.move_on_at(budget.deadline(started)):
                    await waiter.token.wait()
            except BaseException:              # client left, shutdown
                wake(scheduler.leave(waiter, ready=is_ready))
                raise
            budget = budget.spent(started, trio.current_time())
            if waiter.slot is None:            # the budget ran out
                wake(scheduler.leave(waiter, ready=is_ready))
                ...                            # 503 queue_timeout
            slot = waiter.slot
        else:
            slot = result.slot
        try:
            ...                                # the attempt at slot.node
        finally:
            wake(scheduler.release(slot, ready=is_ready))
        tried.add(slot.node)

where ``wake(handoffs)`` is ``for h in handoffs: h.waiter.token.set()``. The
shell also calls ``scheduler.dispatch(ready=...)`` whenever a node changes
between ready, cooling and down (a cooldown starting or ending, a health
check), because that can change which waiters may use which nodes. A
cooldown ends lazily, by expiry, with no event of its own: while the queue
is not empty, the shell must wake at the earliest cooldown end and dispatch.
"""

from .slot_ledger import (
    BALANCE_MODES,
    Balance,
    Choice,
    EngineLoad,
    Exhausted,
    NodeFull,
    Readiness,
    Slot,
    SlotLedger,
    Take,
    Wait,
    choose_node,
)
from .slot_queue import (
    Acquired,
    Granted,
    Handoff,
    QueueBudget,
    Queued,
    QueueFull,
    SlotScheduler,
    Waiter,
)

__all__ = [
    "BALANCE_MODES",
    "Acquired",
    "Balance",
    "Choice",
    "EngineLoad",
    "Exhausted",
    "Granted",
    "Handoff",
    "NodeFull",
    "QueueBudget",
    "QueueFull",
    "Queued",
    "Readiness",
    "Slot",
    "SlotLedger",
    "SlotScheduler",
    "Take",
    "Wait",
    "Waiter",
    "choose_node",
]
