"""A node goes silent mid-request; the proxy must notice through TCP alone.

Run inside a private network namespace, as root::

    unshare -n python tests/netns_scenario.py --dead-peer-timeout 3 \\
        --response-header-timeout 120

In the fresh namespace, the script brings ``lo`` up and starts two fake
nodes: ``first`` on 127.0.0.2, ``second`` on 127.0.0.3. It runs the proxy
in-process with ``first`` ranked first and sends one request. As soon as
``first`` has read the whole request, every packet to or from 127.0.0.2 is
dropped, without a FIN or RST: ``first`` would answer only much later, and
nothing it sends arrives. The proxy's keepalive probes go unanswered, the
kernel fails its ``recv`` with ``ETIMEDOUT``, and ``second`` serves.

The drop is two policy-routing rules of type ``blackhole`` (``ip rule``,
from iproute2), placed ahead of the ``local`` table. The kernel here has
neither netem nor the prio qdisc nor the gact action, so ``tc`` cannot drop
packets, and ``nft``/``iptables`` would need another package; a routing
rule needs only what ``tc`` needs.

The result goes to stdout as one JSON object: the serving node, the status,
the elapsed seconds, the attempts header, what each node saw and the state
of ``first`` afterwards. The script refuses to touch routing outside a
fresh namespace of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import h11
import trio

from trio_failover.core.config import Config, Upstream
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, serve

FIRST_ADDRESS = "127.0.0.2"
SECOND_ADDRESS = "127.0.0.3"
# How long the first node would take to answer once it has gone silent. Its
# answer never arrives; this only bounds the task.
FIRST_ANSWERS_AFTER = 300.0
REQUEST_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _in_private_namespace() -> bool:
    """True when this network namespace is a new one: only ``lo``, not init's."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    names = [line.split(":")[1].strip() for line in links.stdout.splitlines() if line.strip()]
    if names != ["lo"]:
        return False
    try:
        return os.stat("/proc/self/ns/net").st_ino != os.stat("/proc/1/ns/net").st_ino
    except OSError:
        return True  # init's namespace may be hidden from us; a lone lo says enough


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def drop_everything_of(address: str) -> None:
    """Silently drop every packet sent to or from ``address`` (both directions)."""
    for selector in (["from", f"{address}/32"], ["to", f"{address}/32"]):
        _ip("rule", "add", "pref", "10", *selector, "blackhole")
    # The rule that reads the local table sits at pref 0, before anything
    # else; move it behind the blackhole rules (add first, then delete).
    _ip("rule", "add", "pref", "100", "lookup", "local")
    _ip("rule", "del", "pref", "0")


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request:
    request: h11.Request | None = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("the proxy closed before the request was complete")


async def _answer(stream: trio.SocketStream, conn: h11.Connection, text: bytes) -> None:
    headers = [("content-type", "text/plain"), ("content-length", str(len(text)))]
    data = conn.send(h11.Response(status_code=200, headers=headers))
    data += conn.send(h11.Data(data=text))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)


class FakeNode:
    """A node that answers every request with its own name, after ``delay`` seconds.

    ``reached`` is set when a whole request has been read, before the delay.
    """

    def __init__(self, name: str, delay: float) -> None:
        self.name = name
        self.delay = delay
        self.requests = 0
        self.reached = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            await _read_request(stream, conn)
            self.requests += 1
            self.reached.set()
            await trio.sleep(self.delay)
            await _answer(stream, conn, self.name.encode())
        except (trio.BrokenResourceError, ConnectionError):
            pass  # the proxy gave up on this connection; nothing to answer
        finally:
            await trio.aclose_forcefully(stream)

    async def run(
        self, address: str, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(0, host=address)
        task_status.started(listeners[0].socket.getsockname()[1])
        try:
            await trio.serve_listeners(self.handle, listeners)
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)


async def fetch(address: tuple[str, int]) -> tuple[int, dict[str, str], bytes]:
    """POST one JSON request through the proxy; return status, headers, body."""
    stream = await trio.open_tcp_stream(*address)
    try:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method="POST",
            target="/v1/chat/completions",
            headers=[
                ("host", f"{address[0]}:{address[1]}"),
                ("content-type", "application/json"),
                ("content-length", str(len(REQUEST_BODY))),
            ],
        )
        await stream.send_all(conn.send(request) + conn.send(h11.Data(data=REQUEST_BODY)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        status = 0
        headers: dict[str, str] = {}
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, headers, body
    finally:
        await trio.aclose_forcefully(stream)


async def scenario(dead_peer_timeout: float, response_header_timeout: float) -> dict[str, Any]:
    """Run the whole story once; return what happened."""
    first = FakeNode("first", delay=FIRST_ANSWERS_AFTER)
    second = FakeNode("second", delay=0.0)
    result: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        first_port: int = await nursery.start(first.run, FIRST_ADDRESS)
        second_port: int = await nursery.start(second.run, SECOND_ADDRESS)
        config = Config(
            upstreams=(
                Upstream("first", f"http://{FIRST_ADDRESS}:{first_port}"),
                Upstream("second", f"http://{SECOND_ADDRESS}:{second_port}"),
            ),
            listen="127.0.0.1:0",
            admin_listen=None,
            discovery_interval=0,  # the attempt must find the silent node, not a check
            dead_peer_timeout=dead_peer_timeout,
            response_header_timeout=response_header_timeout,
        )
        proxy = Proxy(config)
        shutdown = trio.Event()
        stopped = trio.Event()

        async def run_proxy(task_status: trio.TaskStatus[BoundAddresses]) -> None:
            await serve(config, proxy=proxy, shutdown=shutdown, task_status=task_status)
            stopped.set()

        addresses: BoundAddresses = await nursery.start(run_proxy)

        async def client() -> None:
            started = trio.current_time()
            status, headers, body = await fetch(addresses.client)
            result.update(
                status=status,
                node=headers.get("x-failover-node"),
                attempts=headers.get("x-failover-attempts"),
                body=body.decode(errors="replace"),
                elapsed=round(trio.current_time() - started, 3),
            )

        async with trio.open_nursery() as requests:
            requests.start_soon(client)
            await first.reached.wait()
            drop_everything_of(FIRST_ADDRESS)
            result["dropped_after"] = "first read the whole request"
        nodes = {node["name"]: node for node in proxy.status()["nodes"]}
        result["first_state"] = nodes["first"]["state"]
        result["first_reason"] = nodes["first"]["reason"]
        result["requests"] = {"first": first.requests, "second": second.requests}
        shutdown.set()
        await stopped.wait()
        nursery.cancel_scope.cancel()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dead-peer-timeout", type=float, default=3.0)
    parser.add_argument("--response-header-timeout", type=float, default=120.0)
    parser.add_argument("--limit", type=float, default=40.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    if not _in_private_namespace():
        print(
            "netns_scenario: not in a fresh network namespace of its own; run it under "
            "`unshare -n` (it changes routing rules)",
            file=sys.stderr,
        )
        return 2
    _ip("link", "set", "lo", "up")

    async def bounded() -> dict[str, Any]:
        with trio.fail_after(args.limit):
            return await scenario(args.dead_peer_timeout, args.response_header_timeout)

    try:
        result = trio.run(bounded)
    except trio.TooSlowError:
        print(f"netns_scenario: no answer within {args.limit} s", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
