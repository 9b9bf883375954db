"""What real engines need (issue 19): request ids they accept, SSE pings,
unstreamed answers, Ollama-shaped errors, and the cooldown after a client error.

Whole-proxy tests over in-memory streams under the autojump clock, so every
asserted time is exact.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

import attrs
import h11
import pytest
import trio

from tests.test_client_limits import exchange
from trio_failover import Config
from trio_failover.proxy import Proxy
from trio_failover.testing import (
    Behaviour,
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    frozen,
    healthy,
    request,
    slow_head,
    slow_prefill_with_pings,
)

STREAMED = b'{"model": "m", "stream": true}'
UNSTREAMED = b'{"model": "m"}'
CANONICAL_V4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
LIMIT = 7200.0  # virtual seconds any test here may take


def make_proxy(fleet: Fleet, **settings: object) -> Proxy:
    # These tests time the deadlines themselves: no liveness questions between
    # them (--liveness-interval 0; tests/test_frozen_node.py has the questions).
    settings.setdefault("liveness_interval", 0)
    config = Config(upstreams=fleet.upstreams(), admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


def outcomes(proxy: Proxy) -> list[list[tuple[str, str]]]:
    return [[(a["node"], a["outcome"]) for a in w["attempts"]] for w in proxy.recent]


# -- workload ids ---------------------------------------------------------------------------


def uuid_ids_only(behaviour: Behaviour) -> Behaviour:
    """A node whose request-id middleware refuses any id but a UUID, as llama-cpp-python's."""

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        value = received.header("x-request-id")
        try:
            uuid.UUID((value or b"").decode("ascii"))
        except ValueError:
            await io.send(
                h11.Response(status_code=400, headers=[(b"content-length", b"0")]),
                h11.EndOfMessage(),
            )
            return
        await behaviour(io, received)

    return behave


async def test_generated_ids_are_canonical_uuids_that_a_strict_engine_accepts(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"strict": FakeNode(uuid_ids_only(healthy(b"ok")))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            models = await request(proxy, "GET", "/health")  # /v1/models: the proxy answers
            chat = await request(proxy, body=STREAMED)
        for response in (models, chat):
            assert response is not None
            assert (response.status, response.body) == (200, b"ok")
            sent = response.header("x-request-id")
            assert sent is not None
            assert CANONICAL_V4.fullmatch(sent), sent
        assert [r.header("x-request-id") for r in fleet["strict"].received] == [
            models.header("x-request-id").encode(),  # type: ignore[union-attr]
            chat.header("x-request-id").encode(),  # type: ignore[union-attr]
        ]


async def test_a_clients_own_valid_id_passes_through_unchanged(
    autojump_clock: trio.abc.Clock,
) -> None:
    own = "ebede0e35c12c79a29d38a34"  # a valid client id, though not a UUID
    async with Fleet({"strict": FakeNode(uuid_ids_only(healthy())), "b": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED, headers=[("x-request-id", own)])
        assert response is not None
        # The engine's 400 is its answer to the client's own id: relayed, not hidden.
        assert (response.status, response.header("x-request-id")) == (400, own)
        assert fleet["strict"].received[0].header("x-request-id") == own.encode()
        assert fleet["b"].received == []


# -- SSE pings before the first token --------------------------------------------------------


async def test_pings_do_not_satisfy_the_first_body_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    pinging = FakeNode(slow_prefill_with_pings(26.0))  # pings at 15, first token at 26
    async with Fleet({"pinging": pinging, "peer": FakeNode(healthy(b"peer"))}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=18.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"peer", 18.0)
        assert outcomes(proxy) == [[("pinging", "first_body_timeout"), ("peer", "completed")]]
        cooldown = proxy.cooldowns.get("pinging", trio.current_time())
        assert cooldown is not None
        assert cooldown.until == 18.0 + 120.0


async def test_the_deadline_fires_at_exactly_its_value_among_pings_every_15_s(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Pings at 15, 30, 45 and 60; the deadline of 50 s falls between two.
    pinging = FakeNode(slow_prefill_with_pings(600.0))
    async with Fleet({"pinging": pinging, "peer": FakeNode(healthy(b"peer"))}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=50.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"peer", 50.0)


async def test_held_pings_go_out_with_the_first_token_byte_for_byte(
    autojump_clock: trio.abc.Clock,
) -> None:
    events = (b"data: {}\r\n\r\n", b"data: [DONE]\r\n\r\n")
    pinging = FakeNode(slow_prefill_with_pings(40.0, events=events))
    async with Fleet({"pinging": pinging, "peer": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=60.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.complete
        assert response.body == b": ping\r\n\r\n" * 2 + b"".join(events)
        assert response.chunks[0] == (40.0, b": ping\r\n\r\n" * 2 + events[0])
        assert fleet["peer"].received == []


def fragments(parts: Sequence[bytes], gap: float = 1.0) -> Behaviour:
    """An SSE node that sends ``parts`` as separate body writes, ``gap`` seconds apart."""

    async def behave(io: NodeIO, received: ReceivedRequest) -> None:
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        )
        for part in parts:
            await io.pause(gap)
            await io.send(h11.Data(data=part))
        await io.send(h11.EndOfMessage())

    return behave


SPLIT = [
    # A ping split inside its text and inside its CRLF; the LF that ends a
    # CRLF, read alone, is a blank line, not an event.
    pytest.param([b": pi", b"ng\r", b"\n", b"\r", b"\n", b"data: 1\r\n\r\n"], 6.0, id="crlf"),
    # The rest of a comment line, read later, is still the comment, even
    # when it looks like an event.
    pytest.param([b": ping", b" data: no\n\n", b"data: 1\n\n"], 3.0, id="lf-continued"),
    pytest.param([b": ping\r\r", b"data: 1\r\r"], 2.0, id="cr"),
    # The first event begins after a lone CR at the end of a read.
    pytest.param([b": ping\r", b"\ndata: 1\r\n\r\n"], 2.0, id="crlf-split-before-event"),
]


@pytest.mark.parametrize(("parts", "commit_at"), SPLIT)
async def test_pings_split_across_reads_are_held_exactly(
    autojump_clock: trio.abc.Clock, parts: list[bytes], commit_at: float
) -> None:
    async with Fleet({"split": FakeNode(fragments(parts))}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=100.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.body == b"".join(parts)
        assert response.chunks[0][0] == commit_at


async def test_without_the_first_body_deadline_pings_reach_the_client(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"pinging": FakeNode(slow_prefill_with_pings(40.0))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert [at for at, _ in response.chunks][:3] == [15.0, 30.0, 40.0]


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([b": ping\n\n", b": ping\n\n"], id="ends"),
        pytest.param([b": ping\n\n", b"\n"], id="ends-after-blank"),
    ],
)
async def test_an_event_stream_that_ends_with_only_comments_fails_over_without_cooldown(
    autojump_clock: trio.abc.Clock, parts: list[bytes]
) -> None:
    async with Fleet(
        {"empty": FakeNode(fragments(parts)), "peer": FakeNode(healthy(b"peer"))}
    ) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=100.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.status, response.body, response.at) == (200, b"peer", 2.0)
        assert outcomes(proxy) == [[("empty", "closed_early"), ("peer", "completed")]]
        assert proxy.cooldowns.active(trio.current_time()) == []


async def test_comments_and_the_end_in_one_read_fail_over_too(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def ping_and_end(io: NodeIO, received: ReceivedRequest) -> None:
        head = h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        await io.send(head, h11.Data(data=b": ping\n\n"), h11.EndOfMessage())

    async with Fleet({"empty": FakeNode(ping_and_end), "peer": FakeNode(healthy(b"p"))}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=100.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.body == b"p"
        assert outcomes(proxy)[0][0] == ("empty", "closed_early")


async def test_an_event_stream_that_breaks_after_comments_fails_over_without_cooldown(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def ping_then_close(io: NodeIO, received: ReceivedRequest) -> None:
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
        )
        await io.send(h11.Data(data=b": ping\n\n"))
        await io.pause(1.0)
        await io.stream.aclose()

    async with Fleet(
        {"dies": FakeNode(ping_then_close), "peer": FakeNode(healthy(b"peer"))}
    ) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=100.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"peer", 1.0)
        assert outcomes(proxy)[0][0] == ("dies", "closed_early")
        assert proxy.cooldowns.active(trio.current_time()) == []


async def test_a_flood_of_comments_before_any_event_is_not_held_without_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    flood = FakeNode(fragments([b": " + b"x" * 70_000 + b"\n", b"data: 1\n\n"]))
    async with Fleet({"flood": flood, "peer": FakeNode(healthy(b"peer"))}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=100.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.body == b"peer"
        assert outcomes(proxy)[0][0] == ("flood", "protocol_error")
        assert proxy.cooldowns.active(trio.current_time()) == []


async def test_an_empty_event_stream_with_a_valid_end_commits(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"empty": FakeNode(fragments([])), "peer": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=100.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.status, response.body, response.complete) == (200, b"", True)
        assert fleet["peer"].received == []


# -- the stream-idle timer and pings -----------------------------------------------------------


@pytest.mark.parametrize("first_body_timeout", [0.0, 900.0])
async def test_a_ten_minute_prefill_with_pings_is_never_cut(
    autojump_clock: trio.abc.Clock, first_body_timeout: float
) -> None:
    async with Fleet({"pinging": FakeNode(slow_prefill_with_pings(600.0))}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=first_body_timeout)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert response.complete
        assert response.at == 600.0
        assert outcomes(proxy) == [[("pinging", "completed")]]


@pytest.mark.parametrize("first_body_timeout", [0.0, 900.0])
async def test_pings_after_the_first_token_do_not_restart_the_idle_timer(
    autojump_clock: trio.abc.Clock, first_body_timeout: float
) -> None:
    # The first token at 20 s, then only pings, every 15 s, forever.
    stuck = FakeNode(slow_prefill_with_pings(20.0, stuck_after=1))
    async with Fleet({"stuck": stuck}) as fleet:
        proxy = make_proxy(fleet, first_body_timeout=first_body_timeout)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert not response.complete
        assert response.at == 20.0 + 300.0
        assert outcomes(proxy) == [[("stuck", "stream_idle_timeout")]]
        assert proxy.cooldowns.is_cooling("stuck", trio.current_time())


async def test_other_streams_keep_their_idle_timer_per_chunk(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Not an event stream: every chunk restarts the timer, as before.
    chunks = [b"a", b"b", b"c"]
    slow = FakeNode(healthy(chunks, headers=(), chunk_delay=200.0, content_length=False))
    async with Fleet({"slow": slow}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=STREAMED)
        assert response is not None
        assert (response.body, response.complete, response.at) == (b"abc", True, 400.0)


# -- the unstreamed deadline -------------------------------------------------------------------


async def test_an_unstreamed_answer_after_five_minutes_is_served_by_its_first_node(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"slow": FakeNode(slow_head(300.0, b"whole")), "peer": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, body=UNSTREAMED)
        assert response is not None
        assert (response.body, response.at) == (b"whole", 300.0)
        assert response.header("x-failover-attempts") == "1"
        assert fleet["peer"].received == []


@pytest.mark.parametrize(
    ("target", "body"),
    [
        pytest.param("/v1/chat/completions", STREAMED, id="stream-true"),
        pytest.param("/api/chat", UNSTREAMED, id="ollama-streams-by-default"),
        pytest.param("/health", b"", id="no-json-body"),
    ],
)
async def test_a_streamed_request_still_fails_over_at_the_header_timeout(
    autojump_clock: trio.abc.Clock, target: str, body: bytes
) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "peer": FakeNode(healthy(b"p"))}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, "POST" if body else "GET", target, body=body)
        assert response is not None
        assert (response.body, response.at) == (b"p", 120.0)


@pytest.mark.parametrize(
    ("target", "body"),
    [
        pytest.param("/v1/chat/completions", UNSTREAMED, id="openai-default"),
        pytest.param("/api/generate", b'{"model": "m", "stream": false}', id="ollama-false"),
    ],
)
async def test_an_unstreamed_stall_costs_one_header_timeout_and_a_check_then_down(
    autojump_clock: trio.abc.Clock, target: str, body: bytes
) -> None:
    # With --liveness-interval 0, at the header timeout (120 s) the node is
    # asked GET /health; a frozen node does not answer in min(10 s, 120 s):
    # unresponsive at 130, and down (demoted until a check finds it again).
    async with Fleet({"frozen": FakeNode(frozen()), "peer": FakeNode(healthy(b"p"))}) as fleet:
        proxy = make_proxy(fleet, unstreamed_timeout=450.0)
        with trio.fail_after(LIMIT):
            response = await request(proxy, target=target, body=body)
        assert response is not None
        assert (response.body, response.at) == (b"p", 130.0)
        assert outcomes(proxy)[0][0] == ("frozen", "unresponsive")
        assert proxy.cooldowns.get("frozen", trio.current_time()) is None
        assert proxy.board.nodes["frozen"].down_reason == "unresponsive"


# -- Ollama's error shape on /api/ ---------------------------------------------------------------


def assert_ollama_error(document: object, code: str) -> None:
    assert isinstance(document, dict)
    assert isinstance(document["error"], str)
    assert document["error"]
    assert document["code"] == code


@pytest.mark.parametrize(
    ("nodes", "status", "code"),
    [
        pytest.param({"a": FakeNode(refuse=True)}, 502, "upstream_unavailable", id="502"),
        pytest.param({"a": FakeNode(frozen())}, 504, "upstream_timeout", id="504"),
    ],
)
async def test_every_node_failed_on_api_is_ollamas_shape_with_attempts(
    autojump_clock: trio.abc.Clock, nodes: dict[str, FakeNode], status: int, code: str
) -> None:
    async with Fleet(nodes) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, target="/api/chat", body=STREAMED)
        assert response is not None
        assert response.status == status
        document = response.json()
        assert_ollama_error(document, code)
        assert [a["node"] for a in document["attempts"]] == ["a"]


async def test_the_same_failure_outside_api_keeps_openais_shape(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"a": FakeNode(refuse=True)}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            response = await request(proxy, target="/v1/chat/completions", body=STREAMED)
        assert response is not None
        assert response.json()["error"]["code"] == "upstream_unavailable"


async def test_an_unknown_model_on_api_is_ollamas_404(autojump_clock: trio.abc.Clock) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        node = attrs.evolve(fleet.upstreams()[0], models=("other",))
        config = Config(upstreams=[node], admin_listen=None)
        proxy = Proxy(config, connector=fleet.connector)
        with trio.fail_after(LIMIT):
            response = await request(proxy, target="/api/chat", body=STREAMED)
        assert response is not None
        assert response.status == 404
        assert_ollama_error(response.json(), "model_not_found")


def _post(target: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST "
        + target
        + b" HTTP/1.1\r\nHost: proxy.test\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


CLIENT_ERRORS = [
    pytest.param(
        [_post(b"/api/chat", b"{}", b"Transfer-Encoding: chunked\r\n")],
        400,
        "bad_request",
        id="400-framing",
    ),
    pytest.param(
        [b"POST /api/chat HTTP/1.1\r\nHost: x\r\nBad\nHeader: y\r\n\r\n"],
        400,
        "bad_request",
        id="400-bare-lf",
    ),
    pytest.param(
        [b"POST /api/chat HTTP/1.1\r\nHost: x\r\n"], 408, "request_timeout", id="408-head"
    ),
    pytest.param([_post(b"/api/chat", b"{" * 10)[:-5]], 408, "request_timeout", id="408-body"),
    pytest.param([_post(b"/api/chat?x=1", b"x" * 2048)], 413, "request_too_large", id="413"),
    pytest.param(
        [b"GET /api/tags HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n"],
        431,
        "headers_too_large",
        id="431",
    ),
]


@pytest.mark.parametrize(("parts", "status", "code"), CLIENT_ERRORS)
async def test_client_errors_on_api_are_ollamas_shape(
    autojump_clock: trio.abc.Clock, parts: list[bytes], status: int, code: str
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet, max_request_body=1024)
        result = await exchange(proxy, parts)
        assert result.only.status == status
        assert_ollama_error(result.only.json(), code)
        assert fleet["a"].received == []


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(
            b"POST /v1/chat HTTP/1.1\r\nHost: x\r\nBad\nHeader: y\r\n\r\n", id="openai-path"
        ),
        pytest.param(b"POST  /api/chat HTTP/1.1\r\nHost: x\r\n\r\n", id="malformed-request-line"),
        pytest.param(b"POST /api/chat HTTP/1.1\nHost: x\n\n", id="bare-lf-request-line"),
    ],
)
async def test_a_head_without_a_well_formed_api_request_line_gets_openais_shape(
    autojump_clock: trio.abc.Clock, head: bytes
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        result = await exchange(make_proxy(fleet), [head])
        assert result.only.status == 400
        assert result.only.json()["error"]["code"] == "bad_request"


# -- the cooldown after a relayed answer (docs/failover.md) -----------------------------------


@pytest.mark.parametrize(
    ("status", "cooling_after"),
    [
        pytest.param(200, False, id="200-ends-it"),
        pytest.param(400, False, id="client-error-ends-it"),
        pytest.param(404, False, id="404-ends-it"),
        pytest.param(501, True, id="relayed-5xx-does-not"),
    ],
)
async def test_a_prompt_answer_below_500_from_a_cooling_node_ends_its_cooldown(
    autojump_clock: trio.abc.Clock, status: int, cooling_after: bool
) -> None:
    only = FakeNode(frozen())
    async with Fleet({"only": only}) as fleet:
        proxy = make_proxy(fleet)
        with trio.fail_after(LIMIT):
            stalled = await request(proxy, body=STREAMED)
            assert stalled is not None
            assert stalled.status == 504
            assert proxy.cooldowns.is_cooling("only", trio.current_time())
            body = json.dumps({"error": {"message": "no", "code": "x"}}).encode()
            only.behaviour = healthy(body, status=status)
            answered = await request(proxy, body=STREAMED)
        assert answered is not None
        assert (answered.status, answered.at) == (status, 120.0)
        assert proxy.cooldowns.is_cooling("only", trio.current_time()) is cooling_after
