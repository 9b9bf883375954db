"""A joined replica's heartbeat (``SharedState.beat``) under a mock clock.

Redis is a stand-in here: the replicas' set and the nodes' slot sets on
the Trio clock (in milliseconds, as Redis' ``TIME``), with the scripts'
rules (``HEARTBEAT`` adds a beat and reads every member; ``REAP`` drops a
replica still expired and frees its listed leases). What is tested is the
heartbeat's loop: when it beats, whom it judges dead, that it frees their
leases and at which exact instant, and what it does at a lapse of its own.
The scripts themselves run against a real Redis in ``test_redis_lease.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import trio
import trio.testing

from trio_failover.core.redis_url import RedisAddress
from trio_failover.core.state_layout import Beats, lease_owner
from trio_failover.proxy.fleet.shared_state import SharedState

NODES = ("gpu-1", "gpu-2")


def ms() -> int:
    return round(trio.current_time() * 1000)


@attrs.define
class StandIn:
    """The replicas' set and the slot sets, as Redis would hold them."""

    expiries: dict[str, int] = attrs.Factory(dict)
    slots: dict[str, list[str]] = attrs.Factory(dict)
    reaped: list[tuple[float, dict[str, int]]] = attrs.Factory(list)
    changed: trio.Event = attrs.Factory(trio.Event)

    async def heartbeat(self, replica_id: str, ttl: float, *, deadline: float) -> Beats:
        await trio.lowlevel.checkpoint()
        previous = self.expiries.get(replica_id)
        self.expiries[replica_id] = ms() + round(ttl * 1000)
        return Beats(ms(), previous, dict(self.expiries))

    async def holders(self, nodes: Sequence[str], *, deadline: float) -> dict[str, list[str]]:
        await trio.lowlevel.checkpoint()
        return {node: list(self.slots.get(node, [])) for node in nodes}

    async def reap(
        self, drop: Sequence[str], leases: Mapping[str, Sequence[str]], *, deadline: float
    ) -> dict[str, int]:
        await trio.lowlevel.checkpoint()
        dropped = {}
        for replica in drop:
            if self.expiries.get(replica, ms() + 1) <= ms():
                del self.expiries[replica]
                dropped[replica] = 0
        for node, ids in leases.items():
            for lease in ids:
                if lease_owner(lease) in dropped and lease in self.slots.get(node, []):
                    self.slots[node].remove(lease)
                    dropped[lease_owner(lease)] += 1
        self.reaped.append((trio.current_time(), dropped))
        self.changed.set()
        self.changed = trio.Event()
        return dropped


def replica_a() -> SharedState:
    """Replica ``a``, never joined (its connections are the stand-in): a beat each second."""
    return SharedState(RedisAddress(host="127.0.0.1", port=1), NODES, replica_id="a")


def test_a_replica_killed_at_half_a_second_is_reaped_at_three_its_leases_freed() -> None:
    """x beat at 0 (its beat lasts 3 s) and died at 0.5; a joined at 0 and beats each second.

    a's beats at 1 and 2 see x live (two replicas); its beat at 3.0 sees
    x's beat expired exactly then, and frees x's two leases, not a's own.
    """

    async def main() -> None:
        redis = StandIn()
        state = replica_a()
        assert state.heartbeat_interval == 1.0  # the default 30 s lease TTL
        state.since_ms = (await redis.heartbeat("a", 3.0, deadline=0)).now_ms
        await redis.heartbeat("x", 3.0, deadline=0)
        redis.slots = {"gpu-1": ["x:1", "a:1"], "gpu-2": ["x:2"]}
        counts: list[tuple[float, int]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(state.beat, redis, redis)

            async def count() -> None:
                while True:
                    await state.wait_changed()
                    counts.append((trio.current_time(), state.replicas))

            nursery.start_soon(count)
            await redis.changed.wait()
            nursery.cancel_scope.cancel()
        assert redis.reaped == [(3.0, {"x": 2})]
        assert redis.slots == {"gpu-1": ["a:1"], "gpu-2": []}
        assert "x" not in redis.expiries
        assert counts == [(1.0, 2), (3.0, 1)]  # a counts x live until its beat expires

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_lapse_of_its_own_is_told_and_what_expired_meanwhile_is_not_judged() -> None:
    """At 4.5 another replica dropped a (judged it dead); y's beat expired at 4.8.

    a's beat at 5.0 finds itself gone: it is a lapse (``lapses`` 1), and
    a watches again from 5.0, so y, which expired before, is not a's to
    judge: its leases run out by their TTL. z, which expires at 6.5, after
    a watches again, is reaped at a's beat at 7.0.
    """

    async def main() -> None:
        redis = StandIn()
        state = replica_a()
        state.since_ms = (await redis.heartbeat("a", 3.0, deadline=0)).now_ms
        redis.slots = {"gpu-1": ["y:1", "z:1"]}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(state.beat, redis, redis)
            await trio.sleep(4.5)
            del redis.expiries["a"]
            redis.expiries["y"] = 4_800
            redis.expiries["z"] = 6_500
            while state.lapses == 0:
                await state.wait_changed()
            assert trio.current_time() == 5.0
            assert state.since_ms == 5_000
            await redis.changed.wait()
            nursery.cancel_scope.cancel()
        assert redis.reaped == [(7.0, {"z": 1})]
        assert redis.slots == {"gpu-1": ["y:1"]}
        assert redis.expiries["y"] == 4_800  # left until forgotten, a lease TTL after

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
