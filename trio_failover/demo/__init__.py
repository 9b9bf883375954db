"""``trio-failover demo``: a simulated fleet, the proxy in front, scripted traffic.

Three fake OpenAI-compatible nodes listen on loopback sockets, in ranking
order:

    frozen     accepts the request and never answers
    healthy    answers at once, streams tokens when asked
    dropping   sends a response head, then closes before the body

The proxy runs in front of them with a 2-second response-header timeout, so
a stall costs 2 s and a cooldown lasts 2 s. Five scripted requests then show,
with the proxy's own events printed as they happen:

    1. failover off the frozen node (one stall, then healthy serves);
    2. the cooldown: the next request goes straight to healthy (a stream);
    3. a pre-commit drop: dropping fails, healthy serves, no cooldown;
    4. the cooldown running out: frozen is ready again;
    5. a client abort: the client leaves, the frozen node's connection is
       closed and nothing fails over.

Each step checks what it shows (the steps are in ``script.py``, the live
view in ``view.py``); ``--once`` exits 0 only if all held.
Without ``--once`` the proxy keeps serving on 127.0.0.1:8080 (admin on
8081) for ``curl`` and the dashboard until Ctrl-C.

The demo may import the test kit (its fake nodes) and every layer below;
only the command line imports the demo, and only for ``trio-failover demo``.
"""

from __future__ import annotations

import functools
import json
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence

import attrs
import trio

from ..core.config import Config, Upstream, split_host_port
from ..proxy.nodes.ticker import expire_cooldowns_every
from ..proxy.proxy import Proxy
from ..service.server import BoundAddresses, serve
from ..testing import FakeNode, Fleet, drop_before_body, frozen, openai
from .script import HEADER_TIMEOUT, MODEL, PATH, TOKENS, Check, Script
from .view import Screen, Watcher, quiet_proxy_logs

TICK = 0.1  # how often cooldowns are checked, so "ready again" shows on time
PREFERRED_LISTEN = "127.0.0.1:8080"
PREFERRED_ADMIN = "127.0.0.1:8081"
ANY_PORT = "127.0.0.1:0"
TOKEN_DELAY = 0.08

NODES: tuple[tuple[str, str], ...] = (
    ("frozen", "accepts the request, never answers"),
    ("healthy", "answers at once; streams tokens when asked"),
    ("dropping", "sends a response head, then closes before the body"),
)


def run_demo(once: bool = False) -> int:
    """Run the demo; the ``trio-failover demo [--once]`` command.

    Args:
        once: run the scripted requests, then exit instead of serving on.

    Returns:
        The exit status: 0 when every scripted behaviour was seen (or the
        user stopped the demo with Ctrl-C), 1 when one was not.
    """
    screen = Screen(sys.stdout)
    with quiet_proxy_logs():
        try:
            return trio.run(Demo(screen, once=once).main)
        except KeyboardInterrupt:  # Ctrl-C before the signal receiver was set up
            screen.line("stopped")
            return 0


class Demo:
    """The fleet, the proxy, the script and the serving afterwards."""

    def __init__(self, screen: Screen, *, once: bool) -> None:
        self.screen = screen
        self.once = once
        self.nodes = {
            "frozen": FakeNode(frozen()),
            "healthy": FakeNode(openai(MODEL, tokens=TOKENS, token_delay=TOKEN_DELAY)),
            "dropping": FakeNode(drop_before_body()),
        }
        self.shutdown = trio.Event()
        self.script_scope = trio.CancelScope()
        self.interrupted = False
        self.exit_status = 0

    async def main(self) -> int:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_signals, signals, nursery.cancel_scope)
                await self._run()
                nursery.cancel_scope.cancel()
        return 0 if self.interrupted else self.exit_status

    async def _watch_signals(
        self, signals: AsyncIterator[int], everything: trio.CancelScope
    ) -> None:
        # First signal: stop the script and drain the proxy; second: stop now.
        async for signum in signals:
            if self.interrupted:
                everything.cancel()
                return
            self.interrupted = True
            self.screen.line()
            self.screen.line(f"{signal.Signals(signum).name}: stopping")
            self.script_scope.cancel()
            self.shutdown.set()

    async def _run(self) -> None:
        async with Fleet(self.nodes) as fleet:
            upstreams = [await fleet.serve_tcp(name) for name, _ in NODES]
            config = _demo_config(upstreams, *self._listen_addresses())
            proxy = Proxy(config)
            watcher = Watcher(self.screen, proxy)
            async with trio.open_nursery() as helpers:
                helpers.start_soon(watcher.run)
                # Beside the proxy's own ticker (1 s): "ready again" shows on time.
                helpers.start_soon(expire_cooldowns_every, proxy.board, proxy.queue, TICK)
                async with trio.open_nursery() as server:
                    addresses = await self._start_proxy(server, config, proxy)
                    self._introduce(config, addresses)
                    with self.script_scope:
                        script = Script(self.screen, self.nodes, proxy, addresses, watcher)
                        checks = await script.run()
                        self._summary(checks)
                        if not all(check.passed for check in checks):
                            self.exit_status = 1
                        if not self.once:
                            self._print_serving(addresses)
                            watcher.announce = True
                    if self.once:
                        self.shutdown.set()
                    # The server task ends once ``shutdown`` is set and it drained.
                helpers.cancel_scope.cancel()

    def _listen_addresses(self) -> tuple[str, str]:
        if self.once:  # never collide with anything in CI
            return ANY_PORT, ANY_PORT
        return (
            PREFERRED_LISTEN if _port_is_free(PREFERRED_LISTEN) else ANY_PORT,
            PREFERRED_ADMIN if _port_is_free(PREFERRED_ADMIN) else ANY_PORT,
        )

    async def _start_proxy(
        self, server: trio.Nursery, config: Config, proxy: Proxy
    ) -> BoundAddresses:
        start = functools.partial(serve, config, proxy=proxy, shutdown=self.shutdown)
        try:
            addresses: BoundAddresses = await server.start(start)
        except OSError as exc:
            # Taken between the probe and the bind: any free port will do.
            self.screen.line(f"cannot listen on the usual ports ({exc}); using free ports")
            config = attrs.evolve(config, listen=ANY_PORT, admin_listen=ANY_PORT)
            start = functools.partial(serve, config, proxy=proxy, shutdown=self.shutdown)
            addresses = await server.start(start)
        return addresses

    def _introduce(self, config: Config, addresses: BoundAddresses) -> None:
        screen = self.screen
        screen.line(screen.style("trio-failover demo", "bold"))
        screen.line("Three simulated OpenAI-compatible nodes, in ranking order:")
        screen.table(
            ("node", "address", "behaviour"),
            [
                (up.name, up.url, text)
                for up, (_, text) in zip(config.upstreams, NODES, strict=True)
            ],
        )
        screen.line(f"The proxy listens on {addresses.client_url}, admin on {addresses.admin_url}.")
        for asked, got, what in (
            (PREFERRED_LISTEN, addresses.client, "client"),
            (PREFERRED_ADMIN, addresses.admin, "admin"),
        ):
            if not self.once and got is not None and got[1] != split_host_port(asked)[1]:
                screen.line(f"  ({asked} is taken, so the {what} listener uses port {got[1]})")
        seconds = f"{HEADER_TIMEOUT:g} s"
        screen.line(
            f"Response-header timeout {seconds}: a stalled node costs {seconds},"
            f" then cools down for {seconds}."
        )

    def _summary(self, checks: Sequence[Check]) -> None:
        self.screen.heading("What the demo showed")
        for check in checks:
            mark = (
                self.screen.style("[ok]    ", "green")
                if check.passed
                else self.screen.style("[FAILED]", "red")
            )
            self.screen.line(f"  {mark} {check.behaviour}")
            self.screen.line(f"           {check.detail}")

    def _print_serving(self, addresses: BoundAddresses) -> None:
        screen = self.screen
        url = addresses.client_url
        chat = f"curl -si {url}{PATH} -H 'content-type: application/json' -d '{_CURL_BODY}'"
        stream = f"curl -sN {url}{PATH} -H 'content-type: application/json' -d '{_CURL_STREAM}'"
        screen.heading(f"The proxy keeps serving on {url} until Ctrl-C. Try:")
        screen.line(f"  {chat}")
        screen.line(f"  {stream}")
        screen.line(f"  curl -si -H 'X-Failover-Node: dropping' {url}{PATH} -d '{_CURL_BODY}'")
        if addresses.admin_url:
            screen.line(f"  curl -s {addresses.admin_url}/status")
            screen.line(f"  curl -s {addresses.admin_url}/metrics")
            screen.line(f"Dashboard: {addresses.admin_url}/")
        screen.line(f"OpenAI SDKs: OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY=unused")
        screen.line("Each request is shown below as it happens.")


def _demo_config(upstreams: list[Upstream], listen: str, admin: str) -> Config:
    """The proxy's settings for the demo: short waits, so each step is brief."""
    return Config(
        upstreams=upstreams,
        listen=listen,
        admin_listen=admin,
        connect_timeout=1.0,
        response_header_timeout=HEADER_TIMEOUT,
        # The fake nodes answer at once, whole answers too: the same
        # short wait for both keeps the stall of step 1 brief.
        unstreamed_timeout=HEADER_TIMEOUT,
        stream_idle_timeout=10.0,
        shutdown_timeout=1.0,
        # The script tells failover, step by step: health checks would
        # mark the frozen node down before its first step.
        discovery_interval=0,
    )


_CURL_BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
_CURL_STREAM = json.dumps(
    {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
)


def _port_is_free(address: str) -> bool:
    """Whether ``HOST:PORT`` can be bound now (as Trio's listeners bind, with SO_REUSEADDR)."""
    host, port = split_host_port(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
