"""Request smuggling and header hygiene.

Requests whose framing or head two parsers could read differently are
refused with 400 and the connection closes, before any byte reaches a node.
Hop-by-hop headers never cross the proxy, either way. A node whose response
head h11 rejects fails its attempt before commit: the next candidate
answers, and the client never sees the malformed head.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from test_client_limits import GET, assert_json_error, exchange, make_proxy, post

from trio_failover.testing import Behaviour, FakeNode, Fleet, NodeIO, ReceivedRequest, healthy

HOST = b"Host: proxy.test\r\n"

MALFORMED = {
    "content-length and transfer-encoding": (
        b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "transfer-encoding and content-length": (
        b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n"
        b"Content-Length: 5\r\n\r\n0\r\n\r\n"
    ),
    "transfer-encoding in http/1.0": (
        b"POST / HTTP/1.0\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "unsupported transfer-encoding": (
        b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    ),
    "two transfer-encoding headers": (
        b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "duplicate differing content-length": (
        b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd"
    ),
    "content-length list with differing values": (
        b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 3, 4\r\n\r\nabcd"
    ),
    "signed content-length": b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: +3\r\n\r\nabc",
    "obs-fold with a space": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one\r\n two\r\n\r\n",
    "obs-fold with a tab": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one\r\n\ttwo\r\n\r\n",
    "obs-fold hiding a header": (
        b"GET / HTTP/1.1\r\n" + HOST + b"X-A: x\r\n Transfer-Encoding: chunked\r\n\r\n"
    ),
    "bare cr in a value": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one\rtwo\r\n\r\n",
    "bare lf in a value": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one\nX-B: two\r\n\r\n",
    "bare lf line ends": b"GET / HTTP/1.1\nHost: proxy.test\n\n",
    "bare lf ending the head": b"GET / HTTP/1.1\r\n" + HOST + b"\n",
    "nul in a value": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one\x00two\r\n\r\n",
    "soh in a value": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one\x01two\r\n\r\n",
    "esc in a value": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: \x1b[31mred\r\n\r\n",
    "del in a value": b"GET / HTTP/1.1\r\n" + HOST + b"X-A: one\x7f\r\n\r\n",
    "space before the colon": b"GET / HTTP/1.1\r\n" + HOST + b"X-A : one\r\n\r\n",
    "no host in http/1.1": b"GET / HTTP/1.1\r\nX-A: one\r\n\r\n",
    "garbage request line": b"GET  / HTTP/1.1 extra\r\n" + HOST + b"\r\n",
    "leading empty line": b"\r\nGET / HTTP/1.1\r\n" + HOST + b"\r\n",
}

CHUNKED = b"POST / HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\n"
BAD_CHUNKS = {
    "non-hex chunk size": b"zz\r\nabc\r\n0\r\n\r\n",
    "0x prefix": b"0x3\r\nabc\r\n0\r\n\r\n",
    "negative chunk size": b"-3\r\nabc\r\n0\r\n\r\n",
    "overlong chunk size": b"f" * 30 + b"\r\nabc\r\n0\r\n\r\n",
    "empty chunk size": b"\r\nabc\r\n0\r\n\r\n",
    "chunk longer than its size": b"3\r\nabcd\r\n0\r\n\r\n",
    "chunk size with a bare lf": b"3\nabc\r\n0\r\n\r\n",
    "trailer ending in a bare lf": b"0\r\nX-T: y\n\n",
    "last chunk and a bare lf": b"0\r\n\n",
    "bare cr in an extension": b"3;a\rb\r\nabc\r\n0\r\n\r\n",
    "trailing spaces after a size": b"3  \r\nabc\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("raw", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_malformed_head_gets_400_and_a_close(
    autojump_clock: trio.testing.MockClock, raw: bytes
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        # A valid request follows on the same connection: it must not be served.
        result = await exchange(proxy, raw + GET)
        assert_json_error(result.only, 400, "bad_request")
        assert result.closed_at == 0.0
        assert fleet["a"].received == []
        assert fleet["a"].connections == 0


@pytest.mark.parametrize("chunks", list(BAD_CHUNKS.values()), ids=list(BAD_CHUNKS))
async def test_invalid_chunked_body_gets_400_and_a_close(
    autojump_clock: trio.testing.MockClock, chunks: bytes
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, CHUNKED + chunks + GET)
        assert_json_error(result.only, 400, "bad_request")
        assert result.closed_at == 0.0
        assert fleet["a"].received == []


async def test_smuggled_request_in_an_ambiguous_body_is_never_forwarded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The classic CL.TE attack: a front end going by Content-Length sees one
    # request; one going by Transfer-Encoding sees a second, "smuggled" one.
    smuggled = b"GET /admin HTTP/1.1\r\n" + HOST + b"\r\n"
    body = b"0\r\n\r\n" + smuggled
    raw = (
        b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" % len(body)
    ) + body
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, raw)
        assert_json_error(result.only, 400, "bad_request")
        assert fleet["a"].received == []


async def test_obs_fold_in_a_pipelined_second_request_is_refused_after_the_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    folded = b"GET /second HTTP/1.1\r\n" + HOST + b"X-A: one\r\n two\r\n\r\n"
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, post(b"{}") + folded)
        assert result.statuses == [200, 400]
        assert_json_error(result.responses[1], 400, "bad_request")
        assert [r.target for r in fleet["a"].received] == [b"/v1/chat/completions"]


async def test_valid_pipelined_requests_are_answered_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        chunked = CHUNKED + b"3\r\nabc\r\n0\r\n\r\n"
        result = await exchange(proxy, post(b"one") + chunked + post(b"three"))
        assert result.statuses == [200, 200, 200]
        assert [r.body for r in fleet["a"].received] == [b"one", b"abc", b"three"]


async def test_identical_duplicate_content_length_is_one_length(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # RFC 9110 section 8.6 allows a recipient to take repeated identical
    # values as one; the node sees a single Content-Length.
    raw = b"POST / HTTP/1.1\r\n" + HOST + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc"
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, raw)
        assert result.statuses == [200]
        (received,) = fleet["a"].received
        assert received.body == b"abc"
        assert [v for n, v in received.headers if n == b"content-length"] == [b"3"]


# -- hop-by-hop headers ----------------------------------------------------------------------

HOP_BY_HOP_UP = [
    (b"Connection", b"keep-alive, X-Private-Hop, x-other-hop"),
    (b"Keep-Alive", b"timeout=5"),
    (b"Proxy-Connection", b"keep-alive"),
    (b"Proxy-Authorization", b"Basic c2VjcmV0"),
    (b"TE", b"trailers"),
    (b"Trailer", b"X-Checksum"),
    (b"Upgrade", b"h2c"),
    (b"X-Private-Hop", b"named in Connection"),
    (b"X-Other-Hop", b"named in Connection too"),
]


async def test_hop_by_hop_request_headers_are_not_forwarded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    head = b"".join(name + b": " + value + b"\r\n" for name, value in HOP_BY_HOP_UP)
    raw = b"POST / HTTP/1.1\r\n" + HOST + head + b"X-Kept: yes\r\nContent-Length: 2\r\n\r\n{}"
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, raw)
        assert result.statuses == [200]
        (received,) = fleet["a"].received
        names = {name for name, _ in received.headers}
        assert not names & {name.lower() for name, _ in HOP_BY_HOP_UP}
        assert received.header("x-kept") == b"yes"
        assert received.body == b"{}"


HOP_BY_HOP_DOWN = [
    ("Connection", "keep-alive, X-Node-Private"),
    ("X-Node-Private", "secret"),
    ("Keep-Alive", "timeout=4"),
    ("Proxy-Authenticate", "Basic"),
    ("Trailer", "X-Checksum"),
    ("X-Kept", "yes"),
]


async def test_hop_by_hop_response_headers_are_not_forwarded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Fleet({"a": FakeNode(healthy(b"ok", headers=HOP_BY_HOP_DOWN))}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, GET)
        response = result.only
        assert response.status == 200
        assert response.body == b"ok"
        names = {name for name, _ in response.headers}
        for hop in [b"x-node-private", b"keep-alive", b"proxy-authenticate", b"trailer"]:
            assert hop not in names
        assert response.header("connection") is None
        assert response.header("x-kept") == b"yes"


# -- node response heads that h11 rejects ----------------------------------------------------

BAD_RESPONSE_HEADS = {
    "space in a header name": b"HTTP/1.1 200 OK\r\nBad Name: x\r\nContent-Length: 2\r\n\r\nok",
    "bare cr in a value": b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok",
    "nul in a value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "line without a colon": b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\nok",
    "differing content-lengths": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"
    ),
    "non-numeric content-length": b"HTTP/1.1 200 OK\r\nContent-Length: two\r\n\r\nok",
    "four-digit status": b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok",
    "not http at all": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "unsupported transfer-encoding": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    ),
    "invalid chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n",
    "control byte in the reason": b"HTTP/1.1 200 O\x01K\r\nContent-Length: 2\r\n\r\nok",
    "esc in a value": b"HTTP/1.1 200 OK\r\nX-A: \x1b[0m\r\nContent-Length: 2\r\n\r\nok",
}


def raw_answer(raw: bytes) -> Behaviour:
    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send_raw(raw)
        await io.wait_closed()

    return behave


@pytest.mark.parametrize("raw", list(BAD_RESPONSE_HEADS.values()), ids=list(BAD_RESPONSE_HEADS))
async def test_node_response_that_h11_rejects_fails_over_before_commit(
    autojump_clock: trio.testing.MockClock, raw: bytes
) -> None:
    nodes = {"bad": FakeNode(raw_answer(raw)), "good": FakeNode(healthy(b"fine"))}
    async with Fleet(nodes) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, post(b"{}"))
        response = result.only
        assert response.status == 200
        assert response.body == b"fine"
        assert response.header("x-failover-node") == b"good"
        assert response.header("x-failover-attempts") == b"2"
        assert len(fleet["bad"].received) == 1
        assert proxy.cooldowns.get("bad", trio.current_time()) is None  # no stall: no cooldown


@pytest.mark.parametrize("raw", list(BAD_RESPONSE_HEADS.values()), ids=list(BAD_RESPONSE_HEADS))
async def test_lone_node_with_a_malformed_response_gives_a_clean_502(
    autojump_clock: trio.testing.MockClock, raw: bytes
) -> None:
    async with Fleet({"bad": FakeNode(raw_answer(raw))}) as fleet:
        proxy = make_proxy(fleet)
        result = await exchange(proxy, post(b"{}"))
        response = result.only
        assert response.status == 502
        document = response.json()
        assert document["error"]["code"] == "upstream_unavailable"
        assert [a["node"] for a in document["attempts"]] == ["bad"]
        assert document["attempts"][0]["outcome"] == "protocol_error"
