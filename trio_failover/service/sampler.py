"""The task that fills the dashboard's history (``history.py``) from a running proxy.

One task for the whole fleet, started by the admin listener (``serve_admin``)
and living as long as it: with ``--admin-listen off`` nothing is sampled and
no time to first byte is kept. Each look reads the slot ledger, the queue
and the node counters, which the proxy keeps anyway; the only work on the
request path is the append in ``Metrics.committed``, which this task
switches on while it runs.
"""

from __future__ import annotations

from collections import Counter

import trio

from ..proxy.proxy import Proxy
from .history import History, Reading


def read_nodes(proxy: Proxy) -> dict[str, Reading]:
    """What one look sees of every node: slots in use, waiters it could take, failures."""
    scheduler = proxy.queue.scheduler
    waiting: Counter[str] = Counter()
    for waiter in scheduler.waiting():  # a copy; short unless the fleet is saturated
        waiting.update(waiter.untried)
    stats = proxy.board.nodes
    return {
        node.name: Reading(
            in_flight=scheduler.ledger.in_flight(node.name),
            queued=waiting[node.name],
            failed=stats[node.name].failed,
        )
        for node in proxy.config.upstreams
    }


async def sample_history(proxy: Proxy, history: History) -> None:
    """Look at ``proxy`` ``history.looks`` times per interval, forever.

    Cancellation: the way it ends; the time-to-first-byte append of
    ``Metrics.committed`` is switched off again on the way out.
    """
    metrics = proxy.metrics
    metrics.ttfb_samples = history.ttfb
    try:
        while True:
            now = trio.current_time()
            names = [node.name for node in proxy.config.upstreams]
            if list(history.rings) != names:  # a reload changed the list
                history.follow(names)
            history.observe(now, read_nodes(proxy))
            await trio.sleep_until(history.next_look(now))
    finally:
        metrics.ttfb_samples = {}
