"""Sharing a fleet in the whole proxy, in virtual time: fair share, priority, limits.

Fake nodes over in-memory streams under ``MockClock(autojump_threshold=0)``;
each node notes the instant every request reaches it, so a test asserts
when each workload started. Clients are named by a client header
(``X-Client``), their settings by ``[[client]]`` entries without a key.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import pytest
import trio
from test_queue import BODY, Traffic, ids, in_flight, run_traffic

from trio_failover import Config
from trio_failover.core.client_key import ClientKey
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    Behaviour,
    ClientResponse,
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    request,
    slow_head,
)

DURATION = 1.5  # every request holds its slot this long


class Log:
    """The instant each request (by X-Request-Id) reached a node."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}

    def node(self, duration: float = DURATION) -> FakeNode:
        answer = slow_head(duration)

        async def behave(io: NodeIO, received: ReceivedRequest) -> None:
            rid = (received.header("x-request-id") or b"").decode()
            if rid:
                self.started[rid] = trio.current_time()
            await answer(io, received)

        behaviour: Behaviour = behave
        return FakeNode(behaviour)


def make_proxy(
    fleet: Fleet, clients: tuple[ClientKey, ...] = (), *, capacity: int = 2, **settings: Any
) -> Proxy:
    upstreams = [attrs.evolve(u, capacity=capacity) for u in fleet.upstreams()]
    settings.setdefault("liveness_interval", 0)
    config = Config(
        upstreams=upstreams,
        admin_listen=None,
        client_header="X-Client",
        clients=clients,
        **settings,
    )
    return Proxy(config, connector=fleet.connector)


async def ask(
    proxy: Proxy, rid: str, client: str, *headers: tuple[str, str]
) -> ClientResponse | None:
    return await request(
        proxy, body=BODY, headers=[("x-request-id", rid), ("x-client", client), *headers]
    )


async def flood(
    proxy: Proxy, nursery: trio.Nursery, client: str, count: int, **kw: str
) -> dict[str, ClientResponse | None]:
    """``count`` requests of ``client``, at this instant, each in once the one before is.

    Returns their answers, filled in as they come.
    """
    answers: dict[str, ClientResponse | None] = {}
    headers = tuple(kw.items())

    async def one(rid: str) -> None:
        answers[rid] = await ask(proxy, rid, client, *headers)

    for i in range(count):
        rid = f"{client}-{i}"
        nursery.start_soon(one, rid)
        await until(partial(entered, proxy, answers, rid))  # its place is fixed
    return answers


def entered(proxy: Proxy, answers: dict[str, ClientResponse | None], rid: str) -> bool:
    """Whether workload ``rid`` holds a slot, waits for one, or was answered already."""
    if rid in answers:
        return True
    states = {work["id"]: work["state"] for work in proxy.status()["workloads"]}
    return states.get(rid) in ("queued", "running")


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until ``condition`` holds, without time passing."""
    for _ in range(10_000):
        if condition():
            return
        await trio.lowlevel.checkpoint()
    raise AssertionError("the condition never held")


async def until_queued(proxy: Proxy, count: int) -> None:
    await until(lambda: len(proxy.queue) >= count)


def answers_carry_tokens(proxy: Proxy, prompt: int, completion: int) -> None:
    """Every answer of ``proxy`` reports these tokens (as the engines' usage would)."""
    started = proxy.report.started

    def with_tokens(work: Any, *args: Any, **kw: Any) -> None:
        work.prompt_tokens, work.completion_tokens = prompt, completion
        started(work, *args, **kw)

    proxy.report.started = with_tokens  # type: ignore[method-assign]


# -- fair share: the flood and the newcomer --------------------------------------------


@pytest.mark.parametrize("fair_share", ["on", "off"])
async def test_a_newcomer_starts_at_the_next_freed_slot_despite_a_flood(
    autojump_clock: trio.abc.Clock, fair_share: str
) -> None:
    log = Log()
    async with Fleet({"a": log.node(), "b": log.node()}) as fleet:
        proxy = make_proxy(fleet, fair_share=fair_share)
        waits: list[float] = []
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                await flood(proxy, nursery, "A", 16)
                await until_queued(proxy, 12)  # 4 run, 12 wait
                await trio.sleep(0.5)
                for i in range(3):  # B's, one after another
                    sent = trio.current_time()
                    response = await ask(proxy, f"B-{i}", "B")
                    assert response is not None
                    assert response.status == 200
                    waits.append(log.started[f"B-{i}"] - sent)
        assert in_flight(proxy) == {"a": 0, "b": 0}
    if fair_share == "on":
        # Each of B's starts at the next freed slot: within one request's duration.
        assert waits[0] == 1.0  # sent at 0.5, A's first four end at 1.5
        assert all(wait <= DURATION for wait in waits), waits
    else:
        assert waits[0] == 5.5  # behind A's twelve: three rounds of 1.5 s
        assert max(waits) > 3 * DURATION


async def test_three_clients_of_weights_1_1_2_share_the_slot_seconds_1_1_2(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    weights = {"one": 1.0, "two": 1.0, "four": 2.0}
    clients = tuple(ClientKey(name, weight=weight) for name, weight in weights.items())
    horizon = 300.0  # five virtual minutes
    async with Fleet({"a": log.node(), "b": log.node()}) as fleet:
        proxy = make_proxy(fleet, clients)

        async def worker(client: str, index: int) -> None:
            sent = 0
            while trio.current_time() < horizon:
                response = await ask(proxy, f"{client}-{index}-{sent}", client)
                assert response is not None
                assert response.status == 200
                sent += 1

        with trio.fail_after(horizon + 100):
            async with trio.open_nursery() as nursery:
                for client in weights:
                    for index in range(6):  # always more waiting than slots
                        nursery.start_soon(worker, client, index)
    held = dict.fromkeys(weights, 0.0)
    for rid, started in log.started.items():
        held[rid.split("-")[0]] += max(min(started + DURATION, horizon) - started, 0.0)
    total = sum(held.values())
    assert total == pytest.approx(4 * horizon, rel=0.01)  # the slots were never idle
    normalised = [held[name] / total / (weight / 4) for name, weight in weights.items()]
    jain = sum(normalised) ** 2 / (len(normalised) * sum(x * x for x in normalised))
    assert jain >= 0.99, (held, jain)
    assert all(abs(x - 1) <= 0.05 for x in normalised), held


# -- priority --------------------------------------------------------------------------


async def test_a_low_priority_flood_never_delays_a_normal_request_past_the_next_freed_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    # The flood's weight makes its use count for nothing: only its priority holds it back.
    clients = (ClientKey("batch", priority="low", weight=1000.0),)
    async with Fleet({"a": log.node(), "b": log.node()}) as fleet:
        proxy = make_proxy(fleet, clients)
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                await flood(proxy, nursery, "batch", 16)
                await until_queued(proxy, 12)
                await trio.sleep(0.5)
                answers = await flood(proxy, nursery, "alice", 3)
        assert all(r is not None and r.status == 200 for r in answers.values())
    assert [log.started[f"alice-{i}"] for i in range(3)] == [1.5, 1.5, 1.5]


async def test_a_request_lowers_its_own_priority_with_x_priority_low(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    async with Fleet({"a": log.node()}) as fleet:
        proxy = make_proxy(fleet, capacity=1)
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                await flood(proxy, nursery, "x", 1)  # a's one slot, to 1.5
                nursery.start_soon(ask, proxy, "low", "idle", ("x-priority", "low"))
                await until_queued(proxy, 1)
                # Never raised: "high" stays x's normal.
                nursery.start_soon(ask, proxy, "normal", "x", ("x-priority", "high"))
                await until_queued(proxy, 2)
    # "idle" has used nothing, yet its request said low: x's normal one goes first.
    assert (log.started["normal"], log.started["low"]) == (1.5, 3.0)


async def test_a_queued_event_tells_the_place_in_the_fair_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A client running nothing waits ahead of a busy client's waiters: its event says 1."""
    async with Fleet({"a": FakeNode(slow_head(5.0))}) as fleet:
        proxy = make_proxy(fleet, capacity=1)

        async def script(t: Traffic) -> None:
            busy = (("x-client", "busy"),)
            await t.start("b1", headers=busy)  # a's one slot
            places = [(await t.start(rid, "queued", headers=busy))["position"] for rid in "23"]
            assert places == [1, 2]
            idle = await t.start("i1", "queued", headers=(("x-client", "idle"),))
            assert idle["position"] == 1

        await run_traffic(proxy, script)
        assert ids(fleet["a"]) == ["b1", "i1", "2", "3"]


async def test_a_full_queue_turns_away_the_newest_lower_waiter_for_a_higher_newcomer(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    clients = (ClientKey("batch", priority="low"), ClientKey("boss", priority="high"))
    async with Fleet({"a": log.node()}) as fleet:
        proxy = make_proxy(fleet, clients, max_queue=2)
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                answers = await flood(proxy, nursery, "batch", 4)  # 2 run, 2 wait
                await until_queued(proxy, 2)
                bosses = await flood(proxy, nursery, "boss", 1)
                await until(lambda: "batch-3" in answers)
                assert trio.current_time() == 0.0
                same = await ask(proxy, "batch-late", "batch")  # displaces no one
        boss = bosses["boss-0"]
        assert same is not None
        assert (same.status, same.header("retry-after")) == (503, "1")
        assert same.json()["error"]["code"] == "queue_full"
    displaced = answers["batch-3"]  # the newest of the lowest priority
    assert displaced is not None
    assert (displaced.status, displaced.at, displaced.header("retry-after")) == (503, 0.0, "1")
    assert displaced.json()["error"]["code"] == "queue_full"
    assert boss is not None
    assert boss.status == 200
    assert log.started["boss-0"] == 1.5  # the first freed slot
    assert "batch-3" not in log.started
    rejected = proxy.metrics.registry.get_sample_value(
        "trio_failover_queue_rejected_total", {"reason": "queue_full"}
    )
    assert rejected == 2


# -- limits ----------------------------------------------------------------------------


async def test_max_in_flight_makes_the_extra_wait_while_others_run(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    clients = (ClientKey("x", max_in_flight=1),)
    async with Fleet({"a": log.node(), "b": log.node()}) as fleet:
        proxy = make_proxy(fleet, clients)
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                xs = await flood(proxy, nursery, "x", 3)
                ys = await flood(proxy, nursery, "y", 2)
        assert all(r is not None and r.status == 200 for r in [*xs.values(), *ys.values()])
    assert sorted(log.started[f"x-{i}"] for i in range(3)) == [0.0, 1.5, 3.0]
    assert [log.started[f"y-{i}"] for i in range(2)] == [0.0, 0.0]


async def test_rpm_refuses_the_fourth_request_of_the_minute_with_retry_after(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    clients = (ClientKey("r", rpm=3),)
    async with Fleet({"a": log.node(0.1)}) as fleet:
        proxy = make_proxy(fleet, clients)
        answers: dict[float, ClientResponse | None] = {}
        with trio.fail_after(200):
            for at in (0.0, 10.0, 20.0, 30.0, 59.0, 60.0):
                await trio.sleep_until(at)
                answers[at] = await ask(proxy, f"r-{at}", "r")
            other = await ask(proxy, "other", "s")  # another client is not held back
    statuses = {at: (r.status, r.header("retry-after")) for at, r in answers.items() if r}
    assert statuses == {
        0.0: (200, None),
        10.0: (200, None),
        20.0: (200, None),
        30.0: (429, "30"),
        59.0: (429, "1"),
        60.0: (200, None),  # the one of 0.0 left the window
    }
    refused = answers[30.0]
    assert refused is not None
    assert refused.at == 30.0
    assert refused.json()["error"]["code"] == "rate_limited"
    assert "r-30.0" not in log.started
    assert "r-59.0" not in log.started
    assert other is not None
    assert other.status == 200
    assert [w["status"] for w in proxy.recent if w["id"] == "r-30.0"] == [429]
    # The two refused used nothing: they count as limits hit, not as requests.
    assert proxy.view.document()["clients"] == {"r": {"limits_hit": 2}}
    assert {(e["client"], e["requests"]) for e in proxy.report.usage.document(60.0)["clients"]} == {
        ("r", 4),
        ("s", 1),
    }


async def test_tpm_counts_each_answers_tokens_when_it_ends(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    clients = (ClientKey("t", tpm=100),)
    async with Fleet({"a": log.node(5.0)}) as fleet:
        proxy = make_proxy(fleet, clients)
        answers_carry_tokens(proxy, 40, 20)
        answers: dict[float, ClientResponse | None] = {}
        with trio.fail_after(200):
            for at in (0.0, 5.0, 10.0, 12.0, 64.0, 65.0):
                await trio.sleep_until(at)
                response = await ask(proxy, f"t-{at}", "t")
                answers[at] = response
    statuses = {at: (r.status, r.header("retry-after"), r.at) for at, r in answers.items() if r}
    assert statuses == {
        0.0: (200, None, 5.0),  # 60 tokens charged as it ends, at 5.0
        5.0: (200, None, 10.0),  # 60 held, below 100: admitted; 60 more at 10.0
        10.0: (429, "55", 10.0),  # room when the 60 of 5.0 leave, at 65.0
        12.0: (429, "53", 12.0),
        64.0: (429, "1", 64.0),
        65.0: (200, None, 70.0),
    }


# -- who the client is -----------------------------------------------------------------


async def test_the_client_header_names_the_client_and_a_bad_name_gets_400(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    async with Fleet({"a": log.node(0.1)}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(100):
            named = await ask(proxy, "named", "alice@example.com")
            empty = await ask(proxy, "empty", "")
            bad = await ask(proxy, "bad", "alice smith")
    assert named is not None
    assert empty is not None
    assert bad is not None
    assert (named.status, empty.status, bad.status) == (200, 200, 400)
    assert bad.json()["error"]["code"] == "invalid_client"
    assert "bad" not in log.started  # nothing went to a node
    assert {w["id"]: w["client"] for w in proxy.recent} == {
        "named": "alice@example.com",
        "empty": "anonymous",
    }


async def test_the_client_header_is_ignored_while_keys_are_configured(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    async with Fleet({"a": log.node(0.1)}) as fleet:
        proxy = make_proxy(fleet, (ClientKey("alice", "sk-alice"),))
        with trio.fail_after(100):
            response = await ask(proxy, "r", "not valid!", ("x-api-key", "sk-alice"))
    assert response is not None
    assert response.status == 200
    assert [w["client"] for w in proxy.recent] == ["alice"]


async def test_a_reload_changes_a_clients_share_and_limits_for_the_next_requests(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = Log()
    async with Fleet({"a": log.node(0.1)}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(100):
            first = await ask(proxy, "r-0", "r")
            assert first is not None
            assert first.status == 200
            clients = (ClientKey("r", rpm=1), ClientKey("s", weight=3.0, max_in_flight=2))
            result = await proxy.reload(attrs.evolve(proxy.config, clients=clients))
            assert result.ok
            # The request before the reload was not counted: none was limited then.
            second = await ask(proxy, "r-1", "r")
            third = await ask(proxy, "r-2", "r")
    assert second is not None
    assert third is not None
    assert (second.status, third.status, third.header("retry-after")) == (200, 429, "60")
    use = proxy.queue.scheduler.shares.client("s")
    assert (use.weight, use.max_in_flight) == (3.0, 2)
