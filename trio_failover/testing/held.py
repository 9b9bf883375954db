"""A fake node's behaviour that holds each request until the test lets it go, and counts them.

For capacity tests: how many requests a node has at once (``now``), the
most it ever had (``most``), when each began and ended. Tests import it
from ``trio_failover.testing``::

    held = HeldRequests()
    async with Fleet({"gpu-1": FakeNode(held.behaviour())}) as fleet:
        ...
        await held.wait_for(lambda: held.now == 2)
        held.let_go()  # the requests held now answer; later ones wait
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h11
import trio

from .fakes import Behaviour, NodeIO, ReceivedRequest

__all__ = ["HeldRequests"]


@attrs.define
class HeldRequests:
    """Holds each request until ``let_go`` (or ``let_all_go``), then answers ``{"ok": true}``.

    Attributes:
        leave_with_client: a request also ends when its client closes the
            connection (as an engine stops work for nobody).
        now, most: requests held at this moment, and the most at once.
        started, ended: the Trio time each request began and ended.
    """

    leave_with_client: bool = False
    now: int = 0
    most: int = 0
    started: list[float] = attrs.Factory(list)
    ended: list[float] = attrs.Factory(list)
    _release: trio.Event = attrs.Factory(trio.Event)
    _changed: trio.Event = attrs.Factory(trio.Event)
    _open: bool = False

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds, checked at each request's start and end."""
        while not condition():
            await self._changed.wait()

    def let_go(self) -> None:
        """Answer every request held now; the ones after wait again."""
        self._release.set()
        if not self._open:
            self._release = trio.Event()

    def let_all_go(self) -> None:
        """Answer every request held now and every later one at once."""
        self._open = True
        self._release.set()

    def _told(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def behaviour(self) -> Behaviour:
        async def behave(io: NodeIO, request: ReceivedRequest) -> None:
            release = self._release
            self.now += 1
            self.most = max(self.most, self.now)
            self.started.append(trio.current_time())
            self._told()
            released = False
            try:
                async with trio.open_nursery() as nursery:
                    if self.leave_with_client:

                        async def left() -> None:
                            await io.wait_closed()
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(left)
                    await release.wait()
                    released = True
                    nursery.cancel_scope.cancel()
                # The answer goes out past the nursery: a client gone by now
                # fails the send with a bare BrokenResourceError, which ends
                # this connection as it would a real engine's.
                if released:
                    body = b'{"ok": true}'
                    head = [(b"content-length", b"%d" % len(body))]
                    await io.send(h11.Response(status_code=200, headers=head))
                    await io.send(h11.Data(data=body), h11.EndOfMessage())
            finally:
                self.now -= 1
                self.ended.append(trio.current_time())
                self._told()

        return behave
