"""A proxy's own life: its tasks run in a nursery it owns (``Proxy.run``).

``OwnTasks`` is the part of ``Proxy`` that runs them: ``run`` for
``await nursery.start(proxy.run)``, and ``async with proxy:`` for a block.
What the tasks are is the proxy's (``Proxy._start_own_tasks``); this
module only keeps the one rule about them: a proxy serves only while they
run, and whatever ends them, its pooled connections close.

A proxy nobody runs still serves a connection handed to it
(``Proxy(config, connector=...)`` serves any stream): ``lent`` runs its
tasks, without discovery, in the task of the first such connection, for as
long as any connection so served lasts (the first one's task waits for the
others before it stops them).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar

import trio

from ..wire.pool import ConnectionPool

__all__ = ["OwnTasks"]

Self = TypeVar("Self", bound="OwnTasks")


class OwnTasks:
    """Runs a proxy's own tasks (``_start_own_tasks``) and closes its ``pool`` at the end."""

    pool: ConnectionPool
    _running: bool = False
    _lifetime: trio.Nursery | None = None  # ``async with``'s nursery
    _lifetime_manager: Any = None
    _lent_to = 0  # connections served while ``lent`` runs the tasks
    _lent_over: trio.Event | None = None  # set when the last of them ended

    @property
    def running(self) -> bool:
        """Whether its own tasks run (``run``, ``async with``): it may serve."""
        return self._running

    async def _start_own_tasks(self, nursery: trio.Nursery, *, discovery: bool) -> None:
        raise NotImplementedError

    async def run(
        self: Self,
        *,
        discovery: bool = True,
        task_status: trio.TaskStatus[Self] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the proxy's own tasks until cancelled, then close its pooled connections.

        ``proxy = await nursery.start(Proxy(config).run)`` gives the proxy
        once they run: the cooldown ticker (``ticker.py``), the pool's
        watcher (of idle connections), the watch of every committed stream's
        ``--stream-idle-timeout`` (``silence.py``), discovery and the engines'
        reader.

        Args:
            discovery: False: no checks and no engine reads whatever the
                settings say (``testing.start_in_fleet``: fake nodes see
                only the test's requests).
            task_status: receives the proxy once its tasks run.

        Cancellation: the pool is closed even so. Stop it only after the
        connections it serves ended: a relaying stream loses its idle timer.

        Raises:
            RuntimeError: it runs already.
        """
        if self._running:
            raise RuntimeError("this Proxy runs already")
        try:
            async with trio.open_nursery() as nursery:
                await self._start_own_tasks(nursery, discovery=discovery)
                self._running = True
                task_status.started(self)
        finally:
            self._running = False
            # Shielded, briefly: a close cut by our own cancellation leaks sockets.
            with trio.move_on_after(1.0, shield=True):
                await self.pool.aclose()

    async def __aenter__(self: Self) -> Self:
        """Run the proxy's own tasks (``run``) until the block ends."""
        manager = trio.open_nursery()
        nursery = await manager.__aenter__()
        try:
            await nursery.start(self.run)
        except BaseException as exc:
            await manager.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._lifetime, self._lifetime_manager = nursery, manager
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        nursery, manager = self._lifetime, self._lifetime_manager
        assert nursery is not None, "__aexit__ without __aenter__"
        self._lifetime = self._lifetime_manager = None
        nursery.cancel_scope.cancel()
        # The block's exception leaves unwrapped: the nursery (the proxy's
        # tasks only; a failure of theirs still comes out) is told of none.
        await manager.__aexit__(None, None, None)
        return False

    @asynccontextmanager
    async def lent(self) -> AsyncIterator[None]:
        """Serve one connection of a proxy nobody runs: its tasks run meanwhile.

        The first connection runs them (``run`` without discovery: as a
        bare proxy has always served, checking nothing of its own accord);
        later ones share them; the first one's block ends only after the
        last one's did, then the tasks stop and the pool closes.
        """
        if self._lent_over is not None:  # tasks lent already: share them
            self._lent_to += 1
            try:
                yield
            finally:
                self._lent_to -= 1
                if not self._lent_to:
                    self._lent_over.set()
            return
        over = self._lent_over = trio.Event()
        self._lent_to = 1
        manager = trio.open_nursery()
        nursery = await manager.__aenter__()
        try:
            await nursery.start(functools.partial(self.run, discovery=False))
            try:
                yield
            finally:
                self._lent_to -= 1
                if self._lent_to:
                    await over.wait()
        finally:
            self._lent_over = None
            nursery.cancel_scope.cancel()
            await manager.__aexit__(None, None, None)
