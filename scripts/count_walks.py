"""Count the files one request's walk and one commit's walk run through.

    .venv/bin/python scripts/count_walks.py

One request (``POST /v1/chat/completions``, answered ``200`` by the first
of two healthy fake nodes, over memory streams, no keys, no traces) runs
through a ``Proxy`` under a profiler that notes every call of a function of
the package. Two walks are counted, in modules of the package (the test
kit and the fake nodes, the other ends of the streams, left out):

- the request: from ``Proxy.handle_connection`` to the connection's end;
- the commit: ``Milestones.committed`` and all it calls.

A *stay* is a call that enters a module other than its caller's. The
numbers go into docs/architecture.md ("How far one request walks"), before
and after a change of the shell's structure; the files are printed too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import trio
import trio.lowlevel
import trio.testing

import trio_failover
from trio_failover import Config, Proxy
from trio_failover.testing import FakeNode, Fleet, healthy, request

# The package imported (PYTHONPATH may point at another checkout, for a "before").
PACKAGE = Path(trio_failover.__file__).resolve().parent
OUTSIDE = "testing"  # the test kit's folder: the client's and nodes' side


def _module(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(PACKAGE) or path.relative_to(PACKAGE).parts[0] == OUTSIDE:
        return None
    return path.relative_to(PACKAGE).as_posix()


class Walk:
    """Calls of the package's functions, each as (caller's module, callee's module).

    Only calls in the proxy's tasks count (the task of ``handle_connection``
    and the tasks it starts), and each function call once: the profiler
    reports every resumption of a coroutine as a call again.
    """

    def __init__(self) -> None:
        self.request: list[tuple[str | None, str]] = []
        self.commit: list[tuple[str | None, str]] = []
        self._commit_frame: FrameType | None = None
        self._seen: set[int] = set()
        self._frames: list[FrameType] = []  # kept alive, so that no id is reused
        self._proxy_task: dict[int, bool] = {}

    def _in_proxy(self) -> bool:
        task: Any = trio.lowlevel.current_task()
        known = self._proxy_task.get(id(task))
        if known is None:
            ancestor, known = task, False
            while ancestor is not None and not known:
                known = ancestor.name.endswith("Proxy.handle_connection")
                nursery = ancestor.parent_nursery
                ancestor = nursery.parent_task if nursery is not None else None
            self._proxy_task[id(task)] = known
        return known

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event == "return" and frame is self._commit_frame:
            self._commit_frame = None
        if event != "call" or id(frame) in self._seen:
            return
        callee = _module(frame)
        if callee is None or not self._in_proxy():
            return
        self._seen.add(id(frame))
        self._frames.append(frame)
        caller = _module(frame.f_back) if frame.f_back is not None else None
        self.request.append((caller, callee))
        if frame.f_code.co_qualname == "Milestones.committed":
            self._commit_frame = frame
            self.commit.append((None, callee))
        elif self._commit_frame is not None:
            self.commit.append((caller, callee))


def summary(calls: list[tuple[str | None, str]]) -> tuple[int, int, list[str]]:
    """(files, stays, the files in order of first entry)."""
    files = list(dict.fromkeys(callee for _, callee in calls))
    stays = sum(1 for caller, callee in calls if caller != callee)
    return len(files), stays, files


async def one_request(walk: Walk) -> None:
    nodes = {"a": FakeNode(healthy(b'{"ok":true}')), "b": FakeNode(healthy(b"{}"))}
    async with Fleet(nodes) as fleet:
        config = Config(upstreams=fleet.upstreams())  # a bare Proxy: no checks run
        proxy = Proxy(config, connector=fleet.connector)
        await request(proxy, body=b'{"model":"m"}')  # warm: first imports, the pool
        sys.setprofile(walk.profile)
        try:
            response = await request(proxy, body=b'{"model":"m"}')
        finally:
            sys.setprofile(None)
        assert response is not None
        assert response.status == 200


def main() -> None:
    walk = Walk()
    trio.run(one_request, walk, clock=trio.testing.MockClock(autojump_threshold=0))
    for name, calls in (("request", walk.request), ("commit", walk.commit)):
        files, stays, order = summary(calls)
        print(f"{name}: {files} files, {stays} stays")
        for path in order:
            print(f"  {path}")


if __name__ == "__main__":
    main()
