"""Workload and node events, fanned out to subscribers without back-pressure.

``publish`` never blocks and never fails: each subscriber has a bounded
buffer, and one that falls behind is dropped (its channel closed, with the
reason kept on the subscription) instead of slowing the proxy down. A
proxy with a stuck dashboard attached must serve exactly as fast as one
without.

The event shapes are a public interface (docs/observability.md) and are
built in ``proxy/`` (``workload`` and ``node`` events; ``check`` events of
the liveness checks in ``report.py``); this module only moves them.
"""

from __future__ import annotations

import math
from typing import Any

import trio

Event = dict[str, Any]

SUBSCRIBER_BUFFER = 1024


class Subscription:
    """One subscriber's view of the bus.

    Iterate it for events (the iteration ends when the subscription is
    closed); ``dropped`` then says why: ``"closed"`` for an orderly end, or
    ``"fell behind by more than N events"`` when the buffer overflowed.
    """

    def __init__(self, bus: EventBus, buffer: float) -> None:
        self._bus = bus
        self._send, self.receive = trio.open_memory_channel[Event](buffer)
        self._ended = trio.Event()
        self.dropped: str | None = None

    @property
    def fell_behind(self) -> bool:
        """Whether the bus dropped this subscriber for not keeping up."""
        return self.dropped is not None and self.dropped != "closed"

    def offer(self, event: Event) -> None:
        """Hand ``event`` to the subscriber, or drop the subscriber if its buffer is full."""
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            limit = self._send.statistics().max_buffer_size
            self.close(f"fell behind by more than {limit} events")
        except trio.ClosedResourceError:
            self._bus.discard(self)

    def close(self, reason: str = "closed") -> None:
        """End the subscription: the reader's iteration stops, the bus forgets it.

        The first reason sticks, so a drop is not hidden by the reader's own
        ``close()`` on its way out.
        """
        if self.dropped is None:
            self.dropped = reason
        self._send.close()
        self._bus.discard(self)
        self._ended.set()

    async def wait_ended(self) -> None:
        """Wait until the subscription is closed or dropped (``dropped`` is then set)."""
        await self._ended.wait()

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
        """A new subscription holding up to ``buffer`` unread events (0: unbounded).

        Use it as a context manager so that it is released when the reader
        goes away.
        """
        subscription = Subscription(self, buffer if buffer > 0 else math.inf)
        self._subscribers.add(subscription)
        return subscription

    def discard(self, subscription: Subscription) -> None:
        """Forget ``subscription`` (idempotent)."""
        self._subscribers.discard(subscription)

    @property
    def subscriber_count(self) -> int:
        """How many subscriptions are open."""
        return len(self._subscribers)

    def publish(self, event: Event) -> None:
        """Offer ``event`` to every subscriber; never blocks, never raises.

        Subscribers share the same dict: it must not be changed after
        publishing.
        """
        if not self._subscribers:
            return
        for subscription in list(self._subscribers):
            subscription.offer(event)
