"""The cooldown ticker: one task of the proxy's own (``Proxy.run``).

The cooldown table computes expiry from ``now`` when asked (no timer per
node); this task asks, so an idle proxy still publishes its ``ready`` node
events and keeps the cooling gauge current, whether or not anything
listens. While workloads wait in the queue it also asks at the moment each
cooldown ends: a node turning ready may be what a waiter waits for, and
noticing it dispatches the queue.
"""

from __future__ import annotations

import trio

from .board import NodeBoard
from .queue import SlotQueue

__all__ = ["EXPIRY_TICK", "expire_cooldowns_every"]

EXPIRY_TICK = 1.0


async def expire_cooldowns_every(
    board: NodeBoard, queue: SlotQueue, interval: float = EXPIRY_TICK
) -> None:
    """Notice expired cooldowns every ``interval`` seconds, and when the queue's wake-up comes.

    Runs until cancelled.
    """
    tick = trio.current_time() + interval
    while True:
        with trio.move_on_at(min(tick, queue.wake_at((board.wake_at(),)))):
            await queue.wait_schedule_changed()
        now = trio.current_time()
        board.expire(now)
        if now >= tick:
            tick = now + interval
