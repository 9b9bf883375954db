"""The demo's five scripted requests, each checking the behaviour it shows.

``Script`` runs them against a proxy already serving in front of the fake
fleet (``Demo`` in ``__init__.py`` starts both) and returns one ``Check``
per step, for the summary and the exit status. What each step prints, and
in which order, is part of the demo's output.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from ..proxy.proxy import Proxy
from ..service.server import BoundAddresses
from ..testing import ClientResponse, FakeNode, request_tcp
from .view import Event, Screen, Watcher, answer_line, sse_tokens

HEADER_TIMEOUT = 2.0  # the stall's cost and the cooldown's length
CLIENT_LEAVES_AFTER = 0.5
STEP_LIMIT = 15.0  # no scripted step may take longer than this, whatever breaks
MODEL = "demo"
PATH = "/v1/chat/completions"
TOKENS = 6


@attrs.frozen
class Check:
    """One behaviour the script set out to show, and whether it was seen."""

    behaviour: str
    passed: bool
    detail: str


@attrs.define
class Script:
    """The scripted requests through a serving proxy, step by step."""

    screen: Screen
    nodes: Mapping[str, FakeNode]
    proxy: Proxy
    addresses: BoundAddresses
    watcher: Watcher
    _requests: int = attrs.field(default=0, init=False)

    async def run(self) -> list[Check]:
        """Send the five requests in order; one check per step."""
        steps: list[tuple[str, str | None, Callable[[Script], Awaitable[Check]]]] = [
            (
                "1. Failover off the frozen node",
                "  frozen is first in the ranking; it takes the request and says nothing for"
                f" {HEADER_TIMEOUT:g} s.",
                _step_failover,
            ),
            (
                "2. The cooldown: the next request goes straight to healthy",
                "  frozen is cooling, so it moves behind the ready nodes; a streamed answer:",
                _step_cooldown,
            ),
            (
                "3. A pre-commit drop fails over without a cooldown",
                "  X-Failover-Node puts dropping first; it sends a head, then closes before"
                " the body.",
                _step_drop,
            ),
            ("4. The cooldown runs out", None, _step_expiry),  # its line says how long
            (
                "5. A client abort cancels the upstream work",
                f"  frozen is first again; the client gives up after {CLIENT_LEAVES_AFTER:g} s.",
                _step_abort,
            ),
        ]
        checks = []
        for title, explanation, step in steps:
            self.screen.heading(title)
            if explanation is not None:
                self.screen.line(explanation)
            checks.append(await step(self))
        return checks

    async def send(
        self,
        *,
        body: bytes,
        headers: Sequence[tuple[str, str]] = (),
        leave_after: float | None = None,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> tuple[ClientResponse | None, Event]:
        """One scripted request through the proxy, and its final event."""
        self._requests += 1
        workload = f"demo-{self._requests}"
        shown = "".join(f"  {name}: {value}" for name, value in headers)
        self.screen.line(f"  POST {PATH}  x-request-id: {workload}{shown}")
        all_headers = [("content-type", "application/json"), ("x-request-id", workload)]
        with trio.fail_after(STEP_LIMIT):
            response = await request_tcp(
                self.addresses.client,
                "POST",
                PATH,
                body=body,
                headers=[*all_headers, *headers],
                leave_after=leave_after,
                on_chunk=on_chunk,
            )
            final = await self.watcher.wait_finished(workload)
        if response is not None:
            self.screen.line(
                f"  the client got {response.status}, served by"
                f" {response.header('x-failover-node')} after"
                f" {response.header('x-failover-attempts')} attempt(s): {answer_line(response)}"
            )
        return response, final

    def node(self, name: str) -> dict[str, Any]:
        return next(node for node in self.proxy.status()["nodes"] if node["name"] == name)

    def state(self, name: str) -> str:
        return str(self.node(name)["state"])


# -- the five steps ------------------------------------------------------------------


async def _step_failover(script: Script) -> Check:
    response, final = await script.send(body=_request_body("Hello!"))
    seen = _attempts(final)
    stall = final["attempts"][0]["elapsed_ms"] / 1000 if seen else 0.0
    passed = (
        response is not None
        and response.status == 200
        and seen == [("frozen", "header_timeout"), ("healthy", "completed")]
        and script.state("frozen") == "cooling"
    )
    return Check(
        "failover off the frozen node",
        passed,
        f"frozen stalled for {stall:.1f} s and cooled down; healthy served",
    )


async def _step_cooldown(script: Script) -> Check:
    frozen_before = len(script.nodes["frozen"].received)
    started = trio.current_time()
    tokens: list[str] = []

    def show_tokens(chunk: bytes) -> None:
        for token in sse_tokens(chunk):
            tokens.append(token)
            script.watcher.note(started, f"token {token!r}")  # after the commit it follows

    response, final = await script.send(
        body=_request_body("Count to six.", stream=True),
        on_chunk=show_tokens,
    )
    passed = (
        response is not None
        and response.status == 200
        and response.complete
        and _attempts(final) == [("healthy", "completed")]
        and len(script.nodes["frozen"].received) == frozen_before
        and len(tokens) == TOKENS
    )
    took = final["duration_ms"] / 1000
    return Check(
        "cooldown: the next request went straight to healthy",
        passed,
        f"1 attempt, {len(tokens)} tokens streamed in {took:.2f} s, frozen not contacted",
    )


async def _step_drop(script: Script) -> Check:
    response, final = await script.send(
        body=_request_body("Hello again!"),
        headers=[("x-failover-node", "dropping")],
    )
    seen = _attempts(final)
    passed = (
        response is not None
        and response.status == 200
        and len(seen) >= 2
        and seen[0] == ("dropping", "closed_early")
        and seen[-1] == ("healthy", "completed")
        and script.state("dropping") == "ready"
    )
    return Check(
        "pre-commit drop: failed over, no cooldown",
        passed,
        "dropping closed early, healthy served, dropping stays ready",
    )


async def _step_expiry(script: Script) -> Check:
    script.watcher.mark = trio.current_time()
    remaining = script.node("frozen")["cooldown_remaining_s"]
    script.screen.line(f"  waiting {remaining:.1f} s for frozen's cooldown to end...")

    def frozen_ready() -> bool:
        return any(
            event["node"] == "frozen" and event["state"] == "ready"
            for event in script.watcher.node_events
        )

    with trio.move_on_after(remaining + STEP_LIMIT):
        await script.watcher.wait_for(frozen_ready)
    script.watcher.nodes_table()
    reasons = [e["reason"] for e in script.watcher.node_events if e["node"] == "frozen"]
    passed = frozen_ready() and script.state("frozen") == "ready" and "expired" in reasons
    return Check(
        "cooldown expired: frozen is ready again",
        passed,
        f"after {HEADER_TIMEOUT:g} s, without any request to it",
    )


async def _step_abort(script: Script) -> Check:
    node = script.nodes["frozen"]
    healthy_before = len(script.nodes["healthy"].received)
    closed_before = len(node.closed_at)
    sent = trio.current_time()
    _, final = await script.send(
        body=_request_body("Never mind."),
        leave_after=CLIENT_LEAVES_AFTER,
    )
    with trio.move_on_after(STEP_LIMIT):
        await _wait_until(lambda: len(node.closed_at) > closed_before)
    closed = node.closed_at[-1] - sent if len(node.closed_at) > closed_before else None
    if closed is not None:
        script.screen.line(
            f"  the client left at {CLIENT_LEAVES_AFTER:.2f} s; frozen saw its connection"
            f" closed at {closed:.2f} s"
        )
    passed = (
        closed is not None
        and final["state"] == "cancelled"
        and _attempts(final) == [("frozen", "client_abort")]
        and len(script.nodes["healthy"].received) == healthy_before
        and script.state("frozen") == "ready"
    )
    return Check(
        "client abort: upstream work cancelled, no failover",
        passed,
        (
            f"frozen's connection closed {closed:.2f} s after the request; healthy not tried"
            if closed is not None
            else "frozen's connection was not closed"
        ),
    )


def _attempts(event: Event) -> list[tuple[str, str]]:
    return [(item["node"], item["outcome"]) for item in event["attempts"]]


def _request_body(content: str, *, stream: bool = False) -> bytes:
    document: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
    }
    if stream:
        document["stream"] = True
    return json.dumps(document).encode()


async def _wait_until(condition: Callable[[], bool]) -> None:
    # Only for a fact no event reports: a fake node noticing its connection
    # closed. Polling keeps the fake nodes free of demo-only hooks.
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.01)
