"""proxy/fleet/fair_share.py: the other replicas' figures order this replica's own queue.

Two replicas' ``FleetFairShare`` over an in-memory record channel (what one
publishes, the other hears, through the records' JSON envelope), each with
its own ``SlotQueue``, under ``MockClock(autojump_threshold=0)``. The
shared slots are not here (each queue's node is its own): what is checked
is whom a replica's own freed slot goes to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import pytest
import trio

from trio_failover.core import fleet_records
from trio_failover.core.config import Config, Upstream
from trio_failover.core.slots import Granted, Queued, Slot, Waiter
from trio_failover.proxy.fleet.fair_share import PERIOD, FleetFairShare
from trio_failover.proxy.fleet.shared_state import SharedState
from trio_failover.proxy.nodes.queue import SlotQueue


class Channel:
    """The replicas' record channel: a record one publishes reaches the others at once."""

    def __init__(self) -> None:
        self.replicas: dict[str, FleetFairShare] = {}


class State:
    """What ``FleetFairShare`` uses of a ``SharedState``: joined, and a way to publish."""

    def __init__(self, origin: str, channel: Channel) -> None:
        self.origin, self.channel = origin, channel
        self.connected = True

    async def publish(self, record: Mapping[str, Any], *, node: str | None = None) -> bool:
        envelope = fleet_records.encode_envelope(self.origin, node, record)
        remote = fleet_records.decode_envelope(envelope)
        assert remote is not None
        for origin, fair in self.channel.replicas.items():
            if origin != self.origin:
                fair.on_record(remote)
        return True


def replica(origin: str, channel: Channel, capacity: int) -> tuple[SlotQueue, FleetFairShare]:
    config = Config(
        upstreams=[Upstream("n", "http://127.0.0.1:9", capacity=capacity)], admin_listen=None
    )
    queue = SlotQueue(config, lambda node, now, model=None: False)
    fair = FleetFairShare(queue, cast(SharedState, State(origin, channel)))
    channel.replicas[origin] = fair
    return queue, fair


def start_publishing(
    nursery: trio.Nursery, one: FleetFairShare, two: FleetFairShare
) -> trio.CancelScope:
    """Both replicas publish their summaries; cancelling the scope returned stops ``one``'s."""
    publishing = trio.CancelScope()

    async def publish_one() -> None:
        with publishing:
            await one.publish_all()

    nursery.start_soon(publish_one)
    nursery.start_soon(two.publish_all)
    return publishing


def take(queue: SlotQueue, client: str) -> Slot:
    result = queue.acquire(("n",), tried=(), preferred=None, client=client)
    assert isinstance(result, Granted), result
    return result.slot


def wait(queue: SlotQueue, client: str) -> Waiter[trio.Event]:
    result = queue.acquire(("n",), tried=(), preferred=None, client=client)
    assert isinstance(result, Queued), result
    return result.waiter


@pytest.mark.parametrize("b_runs_here", [False, True])
async def test_a_client_flooding_two_replicas_waits_behind_one_using_only_this_one(
    autojump_clock: trio.abc.Clock, b_runs_here: bool
) -> None:
    """A floods through replicas one and two, B asks through two only.

    At two, A has used 5 slot-seconds and B 20 or more: by two's own
    figures A goes first. But A runs two attempts at one the whole time
    (and has more waiting there): fleet-wide it is not idle, and it used far
    more. So two's next freed slot is B's, whether B runs nothing (idle
    before busy) or runs one there too (then by use: 30-odd against 65-odd).
    """
    channel = Channel()
    one, one_fair = replica("one", channel, 2)
    two, two_fair = replica("two", channel, 3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one_fair.publish_all)
        nursery.start_soon(two_fair.publish_all)
        start = trio.current_time()
        for _ in range(2):
            take(one, "A")  # held to the end
        flood = [wait(one, "A") for _ in range(3)]
        b = take(two, "B")
        await trio.sleep_until(start + 10.0)
        if b_runs_here:
            two.release(b)  # 10 slot-seconds...
            take(two, "B")  # ...and one running on: 30 by 30 s
        await trio.sleep_until(start + 20.0)
        if not b_runs_here:
            two.release(b)  # 20 slot-seconds, then nothing
        a = take(two, "A")
        await trio.sleep_until(start + 25.0)
        two.release(a)  # 5 slot-seconds here
        blockers = [take(two, "X") for _ in range(2 if b_runs_here else 3)]
        a_waits, b_waits = wait(two, "A"), wait(two, "B")  # A first in line
        await trio.sleep_until(start + 30.0)
        assert two.scheduler.use("A", trio.current_time()) < two.scheduler.use(
            "B", trio.current_time()
        )
        two.release(blockers[0])
        assert b_waits.slot is not None  # B's: fleet-wide it used less
        assert a_waits.slot is None
        assert all(waiter.slot is None for waiter in flood)
        nursery.cancel_scope.cancel()


async def test_the_other_replicas_figures_count_while_fresh_and_joined_only(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A summary not renewed (replica gone) or Redis away: each replica's own figures again."""
    channel = Channel()
    one, one_fair = replica("one", channel, 2)
    two, two_fair = replica("two", channel, 2)
    async with trio.open_nursery() as nursery:
        publishing = start_publishing(nursery, one_fair, two_fair)
        take(one, "A")
        await trio.sleep(10.0)
        books = two.scheduler.shares
        assert books.clients["A"].elsewhere == 1
        assert books.fleet_use("A", trio.current_time()) > 9.0
        state = cast(State, two_fair.state)
        state.connected = False  # Redis away: two alone
        await trio.sleep(2 * PERIOD)
        assert books.fleet_use("A", trio.current_time()) == 0.0
        state.connected = True
        await trio.sleep(2 * PERIOD)
        assert books.clients["A"].elsewhere == 1
        publishing.cancel()  # one is gone: its last summary goes stale
        await trio.sleep(3.5)
        assert books.fleet_use("A", trio.current_time()) == 0.0
        nursery.cancel_scope.cancel()


def two_node_replica(origin: str, channel: Channel) -> tuple[SlotQueue, FleetFairShare]:
    upstreams = [Upstream(name, "http://127.0.0.1:9", capacity=4) for name in ("a", "b")]
    config = Config(upstreams=upstreams, admin_listen=None, balance="least-loaded")
    queue = SlotQueue(config, lambda node, now, model=None: False)  # none demoted
    fair = FleetFairShare(queue, cast(SharedState, State(origin, channel)))
    channel.replicas[origin] = fair
    return queue, fair


async def test_the_other_replicas_attempts_count_in_least_loaded_while_fresh_and_joined(
    autojump_clock: trio.abc.Clock,
) -> None:
    """One runs an attempt at a: two sends its next one to b, and counts a's in its own."""
    channel = Channel()
    one, one_fair = two_node_replica("one", channel)
    two, two_fair = two_node_replica("two", channel)

    def next_node(queue: SlotQueue) -> str:
        result = queue.acquire(("a", "b"), tried=(), preferred=None, client="c")
        assert isinstance(result, Granted), result
        queue.release(result.slot)
        return result.slot.node

    async with trio.open_nursery() as nursery:
        publishing = start_publishing(nursery, one_fair, two_fair)
        assert next_node(two) == "a"  # nothing anywhere: a, the first
        held = take_at(one, "a")
        await trio.sleep(2 * PERIOD)
        ledger = two.scheduler.ledger
        assert (ledger.in_flight("a"), ledger.fleet_in_flight("a")) == (0, 1)
        assert next_node(two) == "b"  # a has one attempt, at one
        one.release(held)
        await trio.sleep(2 * PERIOD)
        assert ledger.fleet_in_flight("a") == 0
        assert next_node(two) == "a"
        take_at(one, "a")
        await trio.sleep(2 * PERIOD)
        state = cast(State, two_fair.state)
        state.connected = False  # Redis away: two alone
        await trio.sleep(2 * PERIOD)
        assert ledger.fleet_in_flight("a") == 0
        state.connected = True
        await trio.sleep(2 * PERIOD)
        assert ledger.fleet_in_flight("a") == 1
        publishing.cancel()  # one is gone: its last summary goes stale
        await trio.sleep(3.5)
        assert ledger.fleet_in_flight("a") == 0
        nursery.cancel_scope.cancel()


def take_at(queue: SlotQueue, node: str) -> Slot:
    result = queue.acquire((node,), tried=(), preferred=None, client="c")
    assert isinstance(result, Granted), result
    return result.slot
