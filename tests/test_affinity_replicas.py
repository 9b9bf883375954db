"""Cache affinity across replicas over one real redis-server (docs/capacity.md).

Two ``Proxy`` objects in one process share their state through a real
redis-server (127.0.0.1, the real clock); the nodes are fake ones over
in-memory streams. A conversation's turns alternate between the replicas:
each turn finds its conversation's home, whichever replica served the turn
before. Every wait is for an event, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json

import trio
from conftest import RedisServer
from test_replicas import LIMIT, replicas

from trio_failover.core.affinity import Served
from trio_failover.proxy.proxy import Proxy
from trio_failover.testing import FakeNode, Fleet, healthy, request

CONVERSATIONS = 4
TURNS = 5


class Applied:
    """Counts the ``served`` records another replica's proxy applied."""

    def __init__(self, proxy: Proxy) -> None:
        self.count = 0
        self._changed = trio.Event()
        apply = proxy.affinity.apply

        def counted(record: Served) -> bool:
            applied = apply(record)
            self.count += 1
            self._changed.set()
            self._changed = trio.Event()
            return applied

        proxy.affinity.apply = counted  # type: ignore[method-assign]

    async def wait_for(self, count: int) -> None:
        while self.count < count:
            await self._changed.wait()


def body(conversation: int, turn: int) -> bytes:
    messages = [{"role": "system", "content": "a system prompt all of them share"}]
    for number in range(1, turn + 1):
        messages.append({"role": "user", "content": f"conversation {conversation}, turn {number}"})
        if number < turn:
            messages.append({"role": "assistant", "content": f"answer {number}"})
    return json.dumps({"model": "m", "messages": messages}).encode()


async def test_turns_alternating_between_replicas_stay_on_one_node(
    redis_server: RedisServer,
) -> None:
    nodes = {"gpu-1": FakeNode(healthy()), "gpu-2": FakeNode(healthy())}
    with trio.fail_after(LIMIT):
        async with Fleet(nodes) as fleet, replicas(fleet, redis_server.address) as pair:
            applied = {id(proxy): Applied(proxy) for proxy in pair}
            served = 0  # records each replica has to apply: the other's serves
            told = {id(proxy): 0 for proxy in pair}
            placed: dict[tuple[int, int], str] = {}
            for conversation in range(CONVERSATIONS):
                for turn in range(1, TURNS + 1):
                    proxy, other = pair[turn % 2], pair[(turn + 1) % 2]
                    # turn 1 of every other conversation starts on gpu-2: with
                    # the default priority, every later turn would go to gpu-1
                    home = "gpu-2" if conversation % 2 else "gpu-1"
                    headers = [("x-failover-node", home)] if turn == 1 else []
                    response = await request(proxy, body=body(conversation, turn), headers=headers)
                    assert response is not None
                    assert response.status == 200
                    placed[conversation, turn] = response.header("x-failover-node") or ""
                    served += 1
                    told[id(other)] += 1
                    # the user reads the answer: the other replica hears of it meanwhile
                    await applied[id(other)].wait_for(told[id(other)])
            later = [(c, t) for (c, t) in placed if t > 1]
            stayed = sum(placed[c, t] == placed[c, t - 1] for c, t in later)
            assert stayed / len(later) >= 0.9, placed
            assert {placed[c, 1] for c in range(CONVERSATIONS)} == {"gpu-1", "gpu-2"}
            assert served == CONVERSATIONS * TURNS
            for proxy in pair:
                nodes_status = {node["name"]: node for node in proxy.status()["nodes"]}
                hits = sum(node["affinity"]["hits"] for node in nodes_status.values())
                assert hits >= CONVERSATIONS * (TURNS - 1) // 2 - 1
