"""Workload and node events, fanned out to subscribers without back-pressure.

``publish`` never blocks and never fails: each subscriber has a bounded
buffer, and one that falls behind is dropped (its channel closed, with the
reason kept on the subscription) instead of slowing the proxy down.
"""

from __future__ import annotations

import math
from typing import Any

import trio

Event = dict[str, Any]

SUBSCRIBER_BUFFER = 1024


class Subscription:
    """One subscriber's view: iterate it for events; ``dropped`` says why it ended."""

    def __init__(self, bus: EventBus, buffer: int) -> None:
        self._bus = bus
        self._send, self.receive = trio.open_memory_channel[Event](buffer)
        self.dropped: str | None = None

    def offer(self, event: Event) -> None:
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self.close(f"fell behind by more than {self._send.statistics().max_buffer_size} events")
        except trio.ClosedResourceError:
            self._bus.discard(self)

    def close(self, reason: str = "closed") -> None:
        """End the subscription; the reader's iteration stops."""
        if self.dropped is None:
            self.dropped = reason
        self._send.close()
        self._bus.discard(self)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self.receive.close()


class EventBus:
    """Fan-out of events to any number of subscribers."""

    def __init__(self) -> None:
        self._subscribers: set[Subscription] = set()

    def subscribe(self, buffer: int = SUBSCRIBER_BUFFER) -> Subscription:
        """A new subscription; use it as a context manager so it is released."""
        subscription = Subscription(self, buffer if buffer > 0 else math.inf)  # type: ignore[arg-type]
        self._subscribers.add(subscription)
        return subscription

    def discard(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def publish(self, event: Event) -> None:
        """Offer ``event`` to every subscriber; never blocks."""
        if not self._subscribers:
            return
        for subscription in list(self._subscribers):
            subscription.offer(event)
