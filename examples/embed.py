"""A Trio application that runs trio-failover as one of its own services.

The application owns the nursery: it starts the proxy with
``nursery.start(trio_failover.serve, ...)``, follows the proxy's events to
log failovers and cooldowns in its own words, sends its own traffic through
the proxy, and at the end drains the proxy gracefully with a shutdown event.

    python examples/embed.py                         # two simulated nodes
    python examples/embed.py gpu-a=http://10.0.0.5:8000 gpu-b=http://10.0.0.6:8000

Without arguments it starts two simulated nodes on loopback ports, the first
frozen (it accepts requests and never answers), so the run shows a failover
and a cooldown. With ``NAME=URL`` arguments it proxies to those nodes
instead (OpenAI-compatible servers that know the model ``MODEL``).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

import trio_failover
from trio_failover.testing import FakeNode, Fleet, frozen, openai, request_tcp

MODEL = "demo-model"
HEADER_TIMEOUT = 1.0  # short, so the simulated stall costs one second
REQUESTS = 3


@asynccontextmanager
async def nodes(specs: Sequence[str]) -> AsyncIterator[list[trio_failover.Upstream]]:
    """The nodes to proxy to: the ones named on the command line, or simulated ones."""
    if specs:
        yield [trio_failover.Upstream.parse(spec) for spec in specs]
        return
    fleet_nodes = {"stuck": FakeNode(frozen()), "gpu-b": FakeNode(openai(MODEL))}
    async with Fleet(fleet_nodes) as fleet:
        yield [await fleet.serve_tcp(name) for name in fleet_nodes]


async def report(proxy: trio_failover.Proxy) -> None:
    """The application's own view of the proxy: one log line per notable event."""
    with proxy.events.subscribe() as events:
        async for event in events:
            if event["type"] == "node":
                print(f"[app] node {event['node']} is now {event['state']} ({event['reason']})")
            elif event["state"] == "running" and event["attempt"] > 1:
                print(f"[app] request {event['id']} failed over to {event['node']}")
            elif event["state"] in ("completed", "failed", "cancelled"):
                tried = " -> ".join(f"{a['node']}:{a['outcome']}" for a in event["attempts"])
                print(f"[app] request {event['id']} {event['state']} ({tried})")


async def ask(address: tuple[str, int], number: int) -> str:
    """The application's own work: one chat completion through the proxy."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": f"question {number}"}]}
    ).encode()
    with trio.fail_after(30):
        response = await request_tcp(
            address,
            body=body,
            headers=[("content-type", "application/json"), ("x-request-id", f"app-{number}")],
        )
    assert response is not None
    if response.status != 200:
        return f"error {response.status}"
    return str(response.json()["choices"][0]["message"]["content"]).strip()


async def main(specs: Sequence[str]) -> int:
    async with nodes(specs) as upstreams:
        config = trio_failover.Config(
            upstreams=upstreams,
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            response_header_timeout=HEADER_TIMEOUT,
            # The questions ask for whole answers, whose head comes only when
            # the answer is done: the simulated nodes answer at once, real
            # ones get the default ten minutes.
            unstreamed_timeout=600.0 if specs else HEADER_TIMEOUT,
            shutdown_timeout=5.0,
            # This example is about failover; docs/discovery.md shows the checks.
            discovery_interval=0,
        )
        proxy = trio_failover.Proxy(config)
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(report, proxy)
            async with trio.open_nursery() as server:
                start = functools.partial(
                    trio_failover.serve, config, proxy=proxy, shutdown=shutdown
                )
                addresses: trio_failover.BoundAddresses = await server.start(start)
                print(f"[app] proxy on {addresses.client_url}, admin on {addresses.admin_url}")
                for number in range(1, REQUESTS + 1):
                    answer = await ask(addresses.client, number)
                    print(f"[app] answer {number}: {answer}")
                for node in proxy.status()["nodes"]:
                    print(f"[app] {node['name']}: {node['state']}, served {node['served']}")
                # Graceful stop: no new connections, in-flight requests finish.
                shutdown.set()
            # serve() has returned; the event reader is the only task left.
            nursery.cancel_scope.cancel()
    print("[app] stopped")
    return 0


if __name__ == "__main__":
    # The proxy logs to the standard "trio_failover" logger; this application
    # reports the proxy's events itself, so it keeps only the proxy's errors.
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("trio_failover").setLevel(logging.ERROR)
    sys.exit(trio.run(main, sys.argv[1:]))
