"""The fleet's model lists and health over real 127.0.0.1 sockets.

Fake nodes of several shapes (OpenAI-style ``/v1/models``, Ollama's
``/api/tags``, one that never answers, one that answers garbage) behind the
real listeners of ``serve()``; issue 18's "done when" with a node whose port
closes and opens again; and the official ``ollama`` client listing the
merged models of two fake Ollama nodes. Then, under MockClock over the
in-memory connector, issue 27's cases: the 2 s bound of each live question,
down nodes not asked, a ``"*"``-only node listed, the request id and
access line of a list answer, and the message of a list no node serves.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from typing import Any

import ollama
import pytest
import trio
import trio.testing

from tests.conftest import LogRecords
from tests.test_discovery import chat, listing, routed
from trio_failover import ClientKey, Config, Proxy, Upstream
from trio_failover.core.inventory import CheckFailure, judge_check
from trio_failover.proxy.nodes.lists import Asked, failure_message
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import (
    Behaviour,
    ClientResponse,
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    frozen,
    healthy,
    request,
    request_tcp,
)

INTERVAL = 0.5  # --discovery-interval of the health tests
ANSWER_TIMEOUT = 0.5  # instead of 10 s per node asked, so a silent node costs little


class SocketNode:
    """A fake node on a real port that can be stopped (port closed) and started again."""

    def __init__(self, name: str, behaviour: Behaviour) -> None:
        self.name = name
        self.fake = FakeNode(behaviour)
        self.port = 0
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()

    @property
    def upstream(self) -> Upstream:
        return Upstream(self.name, f"http://127.0.0.1:{self.port}")

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self._run)

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        self._stopped = trio.Event()
        try:
            with trio.CancelScope() as self._scope:
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                self.port = listeners[0].socket.getsockname()[1]
                task_status.started()
                # Closes the listener when cancelled: the port refuses from then on.
                await trio.serve_listeners(self.fake.serve_connection, listeners)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        assert self._scope is not None
        self._scope.cancel()
        await self._stopped.wait()


def tags(*names: str) -> Behaviour:
    """Ollama's ``GET /api/tags`` answer."""
    models = [
        {
            "name": name,
            "model": name,
            "modified_at": "2026-11-30T12:00:00Z",
            "size": 4_700_000_000,
            "digest": f"sha256:{abs(hash(name)):064x}"[:71],
            "details": {"format": "gguf", "family": "llama", "parameter_size": "8B"},
        }
        for name in names
    ]
    return healthy(json.dumps({"models": models}).encode())


def ollama_node(*names: str) -> Behaviour:
    """An Ollama server: ``/api/tags`` and its OpenAI-compatible ``/v1/models``."""
    return routed({b"/api/tags": tags(*names), b"/v1/models": listing(*names)})


def garbage() -> Behaviour:
    """Answers every request with bytes that are not HTTP."""

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send_raw(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await io.stream.aclose()

    return behave


async def get_json(address: tuple[str, int], path: str) -> tuple[int, Any]:
    with trio.fail_after(10):
        response = await request_tcp(address, "GET", path)
    assert response is not None
    return response.status, response.json()


async def wait_status(
    admin: tuple[str, int], name: str, ready: Callable[[dict[str, Any]], bool], within: float
) -> dict[str, Any]:
    """Poll ``/status`` until node ``name`` satisfies ``ready``; fail after ``within`` s."""
    with trio.fail_after(within):
        for _ in range(1000):  # pragma: no branch - the deadline ends it first
            _, status = await get_json(admin, "/status")
            [node] = [node for node in status["nodes"] if node["name"] == name]
            if ready(node):
                return node
            await trio.sleep(0.02)
    raise AssertionError("unreachable")  # pragma: no cover


def proxy_for(*nodes: Upstream, **settings: Any) -> Proxy:
    config = Config(
        upstreams=nodes,
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        connect_timeout=1.0,
        **settings,
    )
    proxy = Proxy(config)
    proxy.lists.answer_timeout = proxy.discovery.answer_timeout = ANSWER_TIMEOUT
    return proxy


async def test_lists_merge_nodes_of_every_shape_and_leave_out_the_silent_and_the_garbled() -> None:
    nodes = [
        SocketNode("openai", routed({b"/v1/models": listing("m1", "m2")})),
        SocketNode("silent", frozen()),
        SocketNode("ollama", ollama_node("llama3:8b", "m1")),
        SocketNode("garbled", garbage()),
        SocketNode("silent-2", frozen()),
        SocketNode("silent-3", frozen()),
    ]
    async with trio.open_nursery() as nursery:
        for node in nodes:
            await node.start(nursery)
        configured = Upstream("configured", "http://127.0.0.1:9", models={"qwen3": "Qwen/Qwen3"})
        proxy = proxy_for(*(node.upstream for node in nodes), configured, discovery_interval=0)
        bound: BoundAddresses = await nursery.start(
            functools.partial(serve, proxy.config, proxy=proxy)
        )
        started = trio.current_time()
        models_status, models = await get_json(bound.client, "/v1/models")
        took = trio.current_time() - started
        tags_status, merged = await get_json(bound.client, "/api/tags")
        nursery.cancel_scope.cancel()
    assert models_status == 200
    assert models["object"] == "list"
    assert [(m["id"], m["nodes"]) for m in models["data"]] == [
        ("m1", ["openai", "ollama"]),
        ("m2", ["openai"]),
        ("llama3:8b", ["ollama"]),
        ("qwen3", ["configured"]),  # from its configuration: never asked
    ]
    assert {m["object"] for m in models["data"]} == {"model"}
    # In parallel: the silent nodes' deadline once, not three times over.
    assert took < 2.5 * ANSWER_TIMEOUT
    assert tags_status == 200
    assert [m["name"] for m in merged["models"]] == ["llama3:8b", "m1"]
    assert merged["models"][0]["details"]["family"] == "llama"  # as the node sent it
    # The silent node was asked both lists; the configured one never.
    assert [r.target for r in nodes[1].fake.received] == [b"/v1/models", b"/api/tags"]


async def test_no_node_answering_is_a_502_in_the_route_s_shape() -> None:
    nodes = [SocketNode("silent", frozen()), SocketNode("garbled", garbage())]
    async with trio.open_nursery() as nursery:
        for node in nodes:
            await node.start(nursery)
        proxy = proxy_for(*(node.upstream for node in nodes), discovery_interval=0)
        bound: BoundAddresses = await nursery.start(
            functools.partial(serve, proxy.config, proxy=proxy)
        )
        models = await get_json(bound.client, "/v1/models")
        tags_answer = await get_json(bound.client, "/api/tags")
        nursery.cancel_scope.cancel()
    # The message says what each node did (issue 27).
    said = "silent did not answer in time, garbled did not answer in HTTP/1.1"
    assert models == (
        502,
        {
            "error": {
                "message": f"no node answered /v1/models: {said}",
                "type": "upstream_error",
                "code": "upstream_unavailable",
            }
        },
    )
    assert tags_answer == (
        502,
        {"error": f"no node answered /api/tags: {said}", "code": "upstream_unavailable"},
    )


async def test_a_bad_answer_is_a_failed_check_with_its_reason_never_a_crash() -> None:
    nodes = [
        SocketNode("garbled", garbage()),
        SocketNode("html", routed({b"/v1/models": healthy(b"<html>hi</html>")})),
        SocketNode("good", routed({b"/v1/models": listing("m1")})),
    ]
    async with trio.open_nursery() as nursery:
        for node in nodes:
            await node.start(nursery)
        proxy = proxy_for(*(node.upstream for node in nodes), discovery_interval=INTERVAL)
        bound: BoundAddresses = await nursery.start(
            functools.partial(serve, proxy.config, proxy=proxy)
        )
        assert bound.admin is not None
        garbled = await wait_status(bound.admin, "garbled", lambda n: n["last_error"], 2.0)
        html = await wait_status(bound.admin, "html", lambda n: n["last_error"], 2.0)
        good = await wait_status(bound.admin, "good", lambda n: n["models"], 2.0)
        nursery.cancel_scope.cancel()
    # Any answer but a refusal, a timeout or a 5xx leaves the node's health alone.
    assert (garbled["state"], garbled["models"], garbled["last_outcome"]) == (
        "ready",
        None,
        "check_bad_answer",
    )
    assert garbled["last_error"].startswith("health check: /v1/models answer is not HTTP/1.1 (")
    assert (html["state"], html["models"], html["last_outcome"]) == (
        "ready",
        None,
        "check_bad_body",
    )
    assert html["last_error"] == "health check: /v1/models answered 200, not a model list: not JSON"
    assert (good["state"], good["models"], good["last_error"]) == ("ready", ["m1"], None)


async def test_inventories_route_and_a_closed_port_is_down_then_ready_within_an_interval() -> None:
    # Issue 18, done when: two nodes without models, one listing m1, the other m2.
    a = SocketNode("a", routed({b"/v1/models": listing("m1")}, healthy(b'"from a"')))
    b = SocketNode("b", routed({b"/v1/models": listing("m2")}, healthy(b'"from b"')))
    async with trio.open_nursery() as nursery:
        await a.start(nursery)
        await b.start(nursery)
        proxy = proxy_for(a.upstream, b.upstream, discovery_interval=INTERVAL)
        bound: BoundAddresses = await nursery.start(
            functools.partial(serve, proxy.config, proxy=proxy)
        )
        assert bound.admin is not None
        await wait_status(bound.admin, "a", lambda n: n["models"] == ["m1"], 1.0 + INTERVAL)
        await wait_status(bound.admin, "b", lambda n: n["models"] == ["m2"], 1.0 + INTERVAL)

        async def post(body: bytes) -> tuple[int, str | None, str | None, Any]:
            with trio.fail_after(10):
                response = await request_tcp(bound.client, body=body)
            assert response is not None
            node, tries = response.header("x-failover-node"), response.header("x-failover-attempts")
            return response.status, node, tries, response.json()

        # m2 goes straight to b: one attempt, a never asked.
        assert await post(chat("m2")) == (200, "b", "1", "from b")
        assert [r.target for r in a.fake.received if r.method == b"POST"] == []
        # The fleet's list: both ids, each with its node.
        status, models = await get_json(bound.client, "/v1/models")
        assert (status, [(m["id"], m["nodes"]) for m in models["data"]]) == (
            200,
            [("m1", ["a"]), ("m2", ["b"])],
        )
        # m3: no node lists it, so every node is a candidate in ranking
        # order (inventories narrow, never refuse: issue 27); a serves it.
        assert await post(chat("m3")) == (200, "a", "1", "from a")

        # a's port closes: down within one interval, and b takes the next request first.
        await a.stop()
        stopped = trio.current_time()
        down = await wait_status(bound.admin, "a", lambda n: n["state"] == "down", 2 * INTERVAL)
        assert trio.current_time() - stopped <= INTERVAL + 0.3  # one interval (+ a loaded CPU)
        assert (down["reason"], down["last_outcome"]) == ("health_check", "check_connect_failed")
        assert down["last_error"].startswith("health check cannot connect (connect: ")
        assert down["models"] == ["m1"]  # a node going away keeps its inventory
        assert await post(chat()) == (200, "b", "1", "from b")
        # Down: not asked, but its known inventory is still listed, as it is
        # still a candidate (the lists show every node that answered or is known).
        _, models = await get_json(bound.client, "/v1/models")
        assert [(m["id"], m["nodes"]) for m in models["data"]] == [("m1", ["a"]), ("m2", ["b"])]

        # a listens again on the same port: ready within one interval.
        await a.start(nursery)
        restarted = trio.current_time()
        ready = await wait_status(bound.admin, "a", lambda n: n["state"] == "ready", 2 * INTERVAL)
        assert trio.current_time() - restarted <= INTERVAL + 0.3
        assert (ready["reason"], ready["last_outcome"]) == (None, "check_ok")
        assert await post(chat()) == (200, "a", "1", "from a")
        nursery.cancel_scope.cancel()


async def test_the_ollama_client_lists_the_merged_models_of_two_nodes() -> None:
    first = SocketNode("gpu-a", ollama_node("llama3:8b", "qwen3:32b"))
    second = SocketNode("gpu-b", ollama_node("qwen3:32b", "mistral:7b"))
    async with trio.open_nursery() as nursery:
        await first.start(nursery)
        await second.start(nursery)
        proxy = proxy_for(first.upstream, second.upstream, discovery_interval=0)
        bound: BoundAddresses = await nursery.start(
            functools.partial(serve, proxy.config, proxy=proxy)
        )

        def listed() -> list[str]:
            # trust_env=False: no HTTP(S)_PROXY of the test machine in the way.
            with ollama.Client(host=bound.client_url, trust_env=False, timeout=10) as client:
                return [str(model.model) for model in client.list().models]

        with trio.fail_after(20):
            names = await trio.to_thread.run_sync(listed)
        nursery.cancel_scope.cancel()
    assert names == ["llama3:8b", "qwen3:32b", "mistral:7b"]


async def test_the_lists_need_a_client_key_like_every_route() -> None:
    node = SocketNode("openai", routed({b"/v1/models": listing("m1")}))
    key = "k-3f6a9c0e1b7d2485"
    async with trio.open_nursery() as nursery:
        await node.start(nursery)
        proxy = proxy_for(node.upstream, discovery_interval=0, clients=[ClientKey("alice", key)])
        bound: BoundAddresses = await nursery.start(
            functools.partial(serve, proxy.config, proxy=proxy)
        )
        with trio.fail_after(10):
            refused = await request_tcp(bound.client, "GET", "/v1/models")
            listed = await request_tcp(
                bound.client, "GET", "/v1/models", headers=[("authorization", f"Bearer {key}")]
            )
        nursery.cancel_scope.cancel()
    assert refused is not None
    assert listed is not None
    assert (refused.status, refused.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (listed.status, [m["id"] for m in listed.json()["data"]]) == (200, ["m1"])
    assert len(node.fake.received) == 1  # the refused request asked no node


# -- the lists under MockClock, over the in-memory connector (issue 27) -------------


def memory_proxy(fleet: Fleet, *nodes: Upstream, **settings: Any) -> Proxy:
    """A proxy over ``fleet`` (discovery not started), nodes as given or one per fake."""
    upstreams = list(nodes) or fleet.upstreams()
    config = Config(upstreams=upstreams, admin_listen=None, **settings)
    return Proxy(config, connector=fleet.connector)


async def get_memory(proxy: Proxy, path: str, **kwargs: Any) -> ClientResponse:
    response = await request(proxy, "GET", path, **kwargs)
    assert response is not None
    return response


async def test_a_frozen_node_costs_a_list_two_seconds_not_ten(
    autojump_clock: trio.abc.Clock,
) -> None:
    # make demo's case: a accepts and answers nothing. On main both lists
    # answered at t=10 (the checks' 10 s); now the live questions get 2 s.
    nodes = {"a": FakeNode(frozen()), "b": FakeNode(ollama_node("m1"))}
    async with Fleet(nodes) as fleet:
        proxy = memory_proxy(fleet, discovery_interval=0)
        models = await get_memory(proxy, "/v1/models")
        models_at = trio.current_time()
        tags_answer = await get_memory(proxy, "/api/tags")
        tags_at = trio.current_time()
    assert models_at == 2.0  # the connect is instant in memory: 2 s for the answer
    assert tags_at - models_at == 2.0
    assert (models.status, [(m["id"], m["nodes"]) for m in models.json()["data"]]) == (
        200,
        [("m1", ["b"])],
    )
    assert (tags_answer.status, [m["name"] for m in tags_answer.json()["models"]]) == (200, ["m1"])
    assert nodes["a"].closed_at == [2.0, 4.0]  # each question closed at its deadline


async def test_a_down_node_is_not_asked_but_its_known_models_are_listed(
    autojump_clock: trio.abc.Clock,
) -> None:
    nodes = {
        "down": FakeNode(frozen()),
        "known": FakeNode(frozen()),
        "live": FakeNode(ollama_node("m2")),
    }
    async with Fleet(nodes) as fleet:
        proxy = memory_proxy(fleet, discovery_interval=0)
        now = trio.current_time()
        refused = judge_check(failure=CheckFailure.CONNECT_FAILED)
        proxy.board.check_finished("down", refused, now)
        proxy.board.check_finished("known", refused, now)
        ok = judge_check(status=200, body=json.dumps({"data": [{"id": "m1"}]}).encode())
        proxy.board.check_finished("known", ok, now)
        proxy.board.check_finished("known", refused, now)  # down, inventory kept
        models = await get_memory(proxy, "/v1/models")
        tags_answer = await get_memory(proxy, "/api/tags")
    assert models.at == 0.0  # nobody frozen was asked: no wait at all
    assert [(m["id"], m["nodes"]) for m in models.json()["data"]] == [
        ("m1", ["known"]),
        ("m2", ["live"]),
    ]
    assert [m["name"] for m in tags_answer.json()["models"]] == ["m2"]
    assert nodes["down"].received == []
    assert nodes["known"].received == []


async def test_a_star_only_node_lists_its_inventory(autojump_clock: trio.abc.Clock) -> None:
    # On main a node whose models is {"*": ...} alone vanished from the list.
    nodes = {"star": FakeNode(listing("Qwen/Qwen3-8B")), "plain": FakeNode(listing("m1"))}
    async with Fleet(nodes) as fleet:
        star = Upstream("star", "http://star.invalid", models={"*": "Qwen/Qwen3-8B"})
        plain = Upstream("plain", "http://plain.invalid")
        # Discovery off: asked live, like a node with nothing configured.
        live = await get_memory(
            memory_proxy(fleet, star, plain, discovery_interval=0), "/v1/models"
        )
        # Discovery on: from its inventory, not asked.
        proxy = memory_proxy(fleet, star, plain, discovery_interval=30.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            await trio.sleep(1.0)
            asked_before = len(nodes["star"].received)
            known = await get_memory(proxy, "/v1/models")
            asked_after = len(nodes["star"].received)
            nursery.cancel_scope.cancel()
    expected = [("Qwen/Qwen3-8B", ["star"]), ("m1", ["plain"])]
    assert [(m["id"], m["nodes"]) for m in live.json()["data"]] == expected
    assert [(m["id"], m["nodes"]) for m in known.json()["data"]] == expected
    assert asked_after == asked_before  # its check's inventory served the list


async def test_list_answers_carry_the_request_id_and_leave_an_access_line(
    autojump_clock: trio.abc.Clock, logged: LogRecords
) -> None:
    nodes = {"a": FakeNode(listing("m1")), "b": FakeNode(frozen())}
    async with Fleet(nodes) as fleet:
        proxy = memory_proxy(fleet, discovery_interval=0)
        given = await get_memory(proxy, "/v1/models", headers=[("X-Request-Id", "list-1")])
        fresh = await get_memory(proxy, "/api/tags")
    assert given.header("x-request-id") == "list-1"
    fresh_id = fresh.header("x-request-id")
    assert fresh_id is not None
    assert uuid.UUID(fresh_id).version == 4
    access = [r.fields for r in logged.records if r.name == "trio_failover.access"]  # type: ignore[attr-defined]
    assert access == [
        {
            "id": "list-1",
            "method": "GET",
            "path": "/v1/models",
            "client": "anonymous",
            "status": 200,
            "state": "completed",
            "nodes": ["a:listed", "b:timed_out"],
            "commit_ms": None,
            "duration_ms": 2000.0,
            "queued_ms": 0.0,
            "bytes": len(given.body),
        },
        {
            "id": fresh_id,
            "method": "GET",
            "path": "/api/tags",
            "client": "anonymous",
            "status": 502,
            "state": "failed",
            "nodes": ["a:not_a_list", "b:timed_out"],
            "commit_ms": None,
            "duration_ms": 2000.0,
            "queued_ms": 0.0,
            "bytes": len(fresh.body),
        },
    ]
    assert proxy.recent == []  # no workload: list loads do not push requests out of /status


async def test_a_list_no_node_serves_says_what_each_node_answered(
    autojump_clock: trio.abc.Clock,
) -> None:
    # ollama.list() in front of two llama-servers: both answer 404 to
    # /api/tags. On main: "no node answered" (502), as if none had answered.
    not_found = healthy(b'{"error": {"code": 404, "message": "File Not Found"}}', status=404)
    nodes = {"a": FakeNode(not_found), "b": FakeNode(not_found)}
    async with Fleet(nodes) as fleet:
        response = await get_memory(memory_proxy(fleet, discovery_interval=0), "/api/tags")
    assert (response.status, response.json()) == (
        502,
        {
            "error": "no node serves /api/tags: a answered 404, b answered 404",
            "code": "upstream_unavailable",
        },
    )


async def test_the_ollama_client_shows_what_the_nodes_answered() -> None:
    not_found = healthy(b'{"error": {"code": 404, "message": "File Not Found"}}', status=404)
    first, second = SocketNode("a", not_found), SocketNode("b", not_found)
    async with trio.open_nursery() as nursery:
        await first.start(nursery)
        await second.start(nursery)
        proxy = proxy_for(first.upstream, second.upstream, discovery_interval=0)
        bound: BoundAddresses = await nursery.start(
            functools.partial(serve, proxy.config, proxy=proxy)
        )

        def listed() -> ollama.ResponseError:
            with ollama.Client(host=bound.client_url, trust_env=False, timeout=10) as client:
                try:
                    client.list()
                except ollama.ResponseError as exc:
                    return exc
            raise AssertionError("the list did not fail")

        with trio.fail_after(20):
            error = await trio.to_thread.run_sync(listed)
        nursery.cancel_scope.cancel()
    assert (error.status_code, error.error) == (
        502,
        "no node serves /api/tags: a answered 404, b answered 404",
    )


MESSAGES = [
    pytest.param(
        [
            Asked("a", None, "status_404", "a answered 404"),
            Asked("b", None, "status_404", "b answered 404"),
        ],
        "no node serves /api/tags: a answered 404, b answered 404",
        id="every-node-answered-404",
    ),
    pytest.param(
        [
            Asked("a", None, "not_a_list", "a answered 200 without a tags list"),
            Asked("b", None, "status_404", "b answered 404"),
        ],
        "no node serves /api/tags: a answered 200 without a tags list, b answered 404",
        id="a-body-that-is-no-list-is-an-answer",
    ),
    pytest.param(
        [
            Asked("a", None, "timed_out", "a did not answer in time"),
            Asked("b", None, "status_404", "b answered 404"),
            Asked("c", None, "down", "c is down"),
        ],
        "no node answered /api/tags: a did not answer in time, b answered 404, c is down",
        id="some-gave-no-answer",
    ),
    pytest.param(
        [Asked("a", b"{}", "listed"), Asked("b", None, "connect_failed", "b cannot be reached")],
        "no node answered /api/tags: b cannot be reached",
        id="only-the-nodes-left-out",
    ),
    pytest.param([], "no node answered /api/tags: none could be asked", id="none"),
]


@pytest.mark.parametrize(("asked", "expected"), MESSAGES)
def test_failure_message(asked: list[Asked], expected: str) -> None:
    assert failure_message("/api/tags", asked) == expected


async def test_a_list_s_access_line_names_the_client_key(
    autojump_clock: trio.abc.Clock, logged: LogRecords
) -> None:
    key = "k-3f6a9c0e1b7d2485"
    async with Fleet({"a": FakeNode(listing("m1"))}) as fleet:
        proxy = memory_proxy(fleet, discovery_interval=0, clients=[ClientKey("alice", key)])
        listed = await get_memory(proxy, "/v1/models", headers=[("x-api-key", key)])
    assert listed.status == 200
    [access] = [r.fields for r in logged.records if r.name == "trio_failover.access"]  # type: ignore[attr-defined]
    assert (access["client"], access["nodes"], access["duration_ms"]) == (
        "alice",
        ["a:listed"],
        0.0,
    )


async def test_a_stored_tags_answer_is_used_and_its_node_not_asked(
    autojump_clock: trio.abc.Clock,
) -> None:
    # FleetLists.known_tags is where discovery's last /api/tags answer of
    # a node plugs in: a node with one is not asked live.
    nodes = {"a": FakeNode(frozen()), "b": FakeNode(ollama_node("m2"))}
    stored = json.dumps({"models": [{"name": "m1:latest", "model": "m1:latest"}]}).encode()
    async with Fleet(nodes) as fleet:
        proxy = memory_proxy(fleet, discovery_interval=0)
        proxy.lists.known_tags = lambda node: stored if node.name == "a" else None  # type: ignore[method-assign]
        answer = await get_memory(proxy, "/api/tags")
    assert (answer.at, [m["name"] for m in answer.json()["models"]]) == (0.0, ["m1:latest", "m2"])
    assert nodes["a"].received == []
