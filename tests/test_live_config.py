"""One live configuration: every part of a proxy reads the one ``LiveConfig`` at use.

A part that kept a copy of the ``Config`` would go on with the old settings
after a reload, silently (the reason for this rule). So the test walks the
objects a running proxy holds, from the ``Proxy`` down through every part of
the package (attributes, slots, containers, bound methods, closures), and
fails on any ``Config`` found anywhere but in the ``LiveConfig`` holder.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import trio

from trio_failover import Config
from trio_failover.core.config import LiveConfig, Upstream
from trio_failover.proxy import Proxy
from trio_failover.testing import FakeNode, Fleet, healthy, request

LIMIT = 60.0  # virtual seconds
MAX_OBJECTS = 200_000  # the walk's bound


def _children(obj: Any) -> list[tuple[str, Any]]:
    """What ``obj`` holds, by name, for the walk."""
    found: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        found += [(f"[{key!r}]", value) for key, value in obj.items()]
    elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
        found += [(f"[{index}]", value) for index, value in enumerate(obj)]
    elif isinstance(obj, functools.partial):
        found += [(".func", obj.func), (".args", obj.args), (".keywords", obj.keywords)]
    elif callable(obj) and hasattr(obj, "__self__"):
        found.append((".__self__", obj.__self__))
    elif callable(obj) and getattr(obj, "__closure__", None):
        names = obj.__code__.co_freevars
        found += [
            (f"<{name}>", cell.cell_contents)
            for name, cell in zip(names, obj.__closure__, strict=True)
        ]
    if type(obj).__module__.startswith("trio_failover"):
        for name in getattr(obj, "__dict__", {}):
            found.append((f".{name}", getattr(obj, name)))
        for klass in type(obj).__mro__:
            for name in getattr(klass, "__slots__", ()):
                if hasattr(obj, name):
                    found.append((f".{name}", getattr(obj, name)))
    return found


def configs_held(root: Any) -> list[str]:
    """The paths from ``root`` to every ``Config`` held outside the one ``LiveConfig``.

    A second ``LiveConfig`` (a part's own holder) counts too: it would not
    see a reload of the proxy's.
    """
    seen: set[int] = set()
    held = []
    holders: list[str] = []
    queue = collections.deque([("proxy", root)])
    while queue and len(seen) < MAX_OBJECTS:
        path, obj = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Config):
            held.append(path)
            continue
        if isinstance(obj, LiveConfig):
            holders.append(path)
            continue  # the one place a Config may be
        for name, child in _children(obj):
            if isinstance(child, str | bytes | int | float | bool | type(None)):
                continue
            queue.append((path + name, child))
    assert len(seen) < MAX_OBJECTS, "the walk did not end: raise its bound"
    return held + holders[1:]


def test_the_walk_finds_a_part_that_keeps_a_copy() -> None:
    class Part:
        def __init__(self, settings: Config) -> None:
            self.settings = settings

    class Holder:
        def __init__(self, part: Part) -> None:
            self.parts = {"a": [part]}

    Part.__module__ = Holder.__module__ = "trio_failover.fake_part"
    real = Config(upstreams=[Upstream("a", "http://a.invalid")], admin_listen=None)
    assert configs_held(Holder(Part(real))) == ["proxy.parts['a'][0].settings"]
    assert configs_held(Holder(Part(LiveConfig(real)))) == []  # type: ignore[arg-type]
    two = Holder(Part(LiveConfig(real)))  # type: ignore[arg-type]
    two.parts["b"] = [Part(LiveConfig(real))]  # type: ignore[arg-type]
    assert configs_held(two) == ["proxy.parts['b'][0].settings"]


async def test_a_running_proxy_keeps_its_configuration_in_one_place(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(healthy()), "b": FakeNode(healthy())}) as fleet:
        config = Config(upstreams=fleet.upstreams(), admin_listen=None, discovery_interval=5.0)
        proxy = Proxy(config, connector=fleet.connector)
        with trio.fail_after(LIMIT):
            async with proxy:
                response = await request(proxy, body=b'{"stream": true}')
                assert response is not None
                assert response.status == 200
                assert configs_held(proxy) == []
                # A reload replaces the one holder's config: every part sees it.
                new = Config(
                    upstreams=fleet.upstreams()[:1],
                    admin_listen=None,
                    discovery_interval=5.0,
                    response_header_timeout=7.0,
                )
                result = await proxy.reload(new)
                assert result.ok
                assert configs_held(proxy) == []
                assert proxy.live.config is new
                parts = [proxy.report, proxy.view, proxy.liveness, proxy.lists, proxy.discovery]
                parts += [proxy.engine_reader, proxy._workloads.attempts]
                assert all(part.config is new for part in parts)
