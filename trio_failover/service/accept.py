"""Taking a listener's waiting connections in one pass of the scheduler (issue 33).

``server._accept_loop`` awaits one ``accept`` (its wait and its checkpoint)
and then calls ``accept_pending`` for the rest of the backlog; see
docs/performance.md, "New streams under load".
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import trio

__all__ = ["ACCEPT_BATCH", "accept_pending"]

# Connections accepted in one pass of the scheduler at most (the standard
# library's event loop takes as many per wake-up): far above what steady
# churn leaves waiting between two passes, and it keeps a burst's new work
# in one pass in proportion, so that the running streams' next chunks wait
# for a hundred first steps at most, not for thousands.
ACCEPT_BATCH = 100


def accept_pending(
    listener: trio.SocketListener,
    limiter: trio.CapacityLimiter,
    start: Callable[[trio.SocketStream, object], None],
    most: int,
) -> int:
    """Accept the connections already in ``listener``'s backlog, up to ``most``.

    Not a checkpoint. Each awaited ``accept`` is a pass through the
    scheduler, and under load one pass runs every ready stream's chunk
    first: one connection per pass let new clients queue in the backlog
    for seconds while running streams flowed (issue 33). So after the
    awaited accept, the loop takes the rest here, until ``EAGAIN``,
    ``most`` connections, or ``limiter`` without a token. Any error ends
    the batch: the next awaited accept meets it again and handles it.

    Args:
        listener: the listening socket.
        limiter: ``--max-connections``; a token is taken per connection.
        start: called with each accepted stream and its token.
        most: how many connections to accept at most.

    Returns:
        how many connections were accepted.
    """
    listening = listener.socket
    # A stdlib socket object over the same descriptor, detached at the end:
    # Trio's own accept always yields. The descriptor is non-blocking.
    raw = socket.socket(listening.family, listening.type, listening.proto, listening.fileno())
    accepted = 0
    try:
        while accepted < most:
            token = object()
            try:
                limiter.acquire_on_behalf_of_nowait(token)
            except trio.WouldBlock:
                return accepted
            try:
                client, _ = raw.accept()
            except OSError:  # BlockingIOError (the backlog is empty) or any other
                limiter.release_on_behalf_of(token)
                return accepted
            start(trio.SocketStream(trio.socket.from_stdlib_socket(client)), token)
            accepted += 1
        return accepted
    finally:
        raw.detach()
