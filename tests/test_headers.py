"""Table-driven tests of header hygiene (trio_failover.headers).

Headers are h11's form throughout: ``(name, value)`` byte pairs with
lower-case names, as h11 hands them to the proxy.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from trio_failover.core.headers import (
    FRAMING,
    HOP_BY_HOP,
    Headers,
    client_response_headers,
    connection_tokens,
    end_to_end,
    get,
    upstream_request_headers,
)


def _h(*lines: str) -> Headers:
    """Headers from ``"name: value"`` lines (h11 lower-cases names)."""
    pairs = []
    for line in lines:
        name, _, value = line.partition(":")
        pairs.append((name.strip().lower().encode(), value.strip().encode()))
    return pairs


def _values(headers: Headers, name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]


# -- hop-by-hop and framing ------------------------------------------------------------

END_TO_END = [
    pytest.param(
        _h("accept: */*", "user-agent: curl"), (), _h("accept: */*", "user-agent: curl"), id="kept"
    ),
    pytest.param(
        _h("set-cookie: a=1", "content-type: text/plain", "set-cookie: b=2"),
        (),
        _h("set-cookie: a=1", "content-type: text/plain", "set-cookie: b=2"),
        id="order-and-repeats-kept",
    ),
    pytest.param(
        [(name, b"x") for name in sorted(HOP_BY_HOP)] + _h("accept: */*"),
        (),
        _h("accept: */*"),
        id="every-hop-by-hop-dropped",
    ),
    pytest.param(
        _h("content-length: 5", "accept: */*"), (), _h("accept: */*"), id="length-dropped"
    ),
    pytest.param(_h("transfer-encoding: chunked"), (), [], id="chunked-dropped"),
    pytest.param(
        _h("connection: close, X-Secret", "x-secret: 1", "x-other: 2"),
        (),
        _h("x-other: 2"),
        id="connection-listed-dropped",
    ),
    pytest.param(
        _h(
            "connection: keep-alive",
            "connection: x-a,x-b ,  X-C",
            "x-a: 1",
            "x-b: 2",
            "x-c: 3",
            "x-d: 4",
        ),
        (),
        _h("x-d: 4"),
        id="several-connection-lines",
    ),
    pytest.param(
        _h("x-request-id: theirs", "accept: */*"),
        (b"x-request-id",),
        _h("accept: */*"),
        id="drop-set",
    ),
]


@pytest.mark.parametrize(("headers", "drop", "expected"), END_TO_END)
def test_end_to_end(headers: Headers, drop: tuple[bytes, ...], expected: Headers) -> None:
    assert end_to_end(headers, frozenset(drop)) == expected
    # Any iterable: a generator is read twice inside and must not run dry.
    assert end_to_end((pair for pair in headers), frozenset(drop)) == expected


@pytest.mark.parametrize(
    ("headers", "tokens"),
    [
        pytest.param([], set(), id="none"),
        pytest.param(_h("accept: */*"), set(), id="no-connection-header"),
        pytest.param(_h("connection: close"), {b"close"}, id="close"),
        pytest.param(
            _h("connection: Keep-Alive, X-Foo"), {b"keep-alive", b"x-foo"}, id="folded-case"
        ),
        pytest.param(_h("connection: a", "connection: b"), {b"a", b"b"}, id="two-lines"),
    ],
)
def test_connection_tokens(headers: Headers, tokens: set[bytes]) -> None:
    assert connection_tokens(headers) == tokens


def test_framing_is_content_length_and_transfer_encoding() -> None:
    assert {b"content-length", b"transfer-encoding"} == FRAMING


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param(b"x-request-id", b"first", id="first-of-two"),
        pytest.param(b"accept", b"*/*", id="single"),
        pytest.param(b"absent", None, id="absent"),
    ],
)
def test_get(name: bytes, value: bytes | None) -> None:
    headers = _h("x-request-id: first", "accept: */*", "x-request-id: second")
    assert get(headers, name) == value


# -- headers sent upstream -----------------------------------------------------------------


def _upstream(
    client: Headers,
    *,
    node_headers: Mapping[str, str] | None = None,
    client_address: str | None = "10.0.0.9",
    scheme: str = "http",
    content_length: int | None = 12,
) -> Headers:
    return upstream_request_headers(
        client,
        host="gpu-a.test:8000",
        request_id="wid-1",
        client_address=client_address,
        client_scheme=scheme,
        node_headers=node_headers or {},
        content_length=content_length,
    )


def test_upstream_request_headers_whole_list() -> None:
    client = _h(
        "host: proxy.test:8080",
        "user-agent: openai-python",
        "connection: keep-alive, x-hop",
        "keep-alive: timeout=5",
        "x-hop: 1",
        "content-type: application/json",
        "content-length: 99",
        "x-failover-node: gpu-b",
        "x-request-id: client-id",
        "x-forwarded-proto: https",
        "accept: text/event-stream",
    )
    assert _upstream(client) == _h(
        "host: gpu-a.test:8000",
        "user-agent: openai-python",
        "content-type: application/json",
        "accept: text/event-stream",
        "x-forwarded-for: 10.0.0.9",
        "x-forwarded-proto: http",
        "x-request-id: wid-1",
        "content-length: 12",
    )


# (client's X-Forwarded-For lines, client address, the chain the node sees)
FORWARDED_FOR = [
    pytest.param([], "10.0.0.9", b"10.0.0.9", id="starts-a-chain"),
    pytest.param(["1.1.1.1"], "10.0.0.9", b"1.1.1.1, 10.0.0.9", id="appends"),
    pytest.param(["1.1.1.1, 2.2.2.2"], "10.0.0.9", b"1.1.1.1, 2.2.2.2, 10.0.0.9", id="long-chain"),
    pytest.param(["1.1.1.1", "2.2.2.2"], "10.0.0.9", b"1.1.1.1, 2.2.2.2, 10.0.0.9", id="two-lines"),
    pytest.param([], "::1", b"::1", id="ipv6"),
    pytest.param(["1.1.1.1"], None, b"1.1.1.1", id="no-address-keeps-chain"),
    pytest.param([], None, None, id="no-address-no-chain"),
]


@pytest.mark.parametrize(("lines", "address", "chain"), FORWARDED_FOR)
def test_x_forwarded_for(lines: list[str], address: str | None, chain: bytes | None) -> None:
    client = [(b"x-forwarded-for", line.encode()) for line in lines]
    headers = _upstream(client, client_address=address)
    assert _values(headers, b"x-forwarded-for") == ([] if chain is None else [chain])


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_x_forwarded_proto_is_the_client_scheme(scheme: str) -> None:
    headers = _upstream(_h("x-forwarded-proto: gopher"), scheme=scheme)
    assert _values(headers, b"x-forwarded-proto") == [scheme.encode()]


@pytest.mark.parametrize(
    ("length", "values"),
    [
        pytest.param(None, [], id="no-body"),
        pytest.param(0, [b"0"], id="empty-body"),
        pytest.param(12, [b"12"], id="body"),
    ],
)
def test_content_length_is_the_buffered_body(length: int | None, values: list[bytes]) -> None:
    headers = _upstream(
        _h("content-length: 99", "transfer-encoding: chunked"), content_length=length
    )
    assert _values(headers, b"content-length") == values
    assert _values(headers, b"transfer-encoding") == []


# (client headers, the node's configured headers, name, the values the node sees)
NODE_HEADERS = [
    pytest.param(
        _h("authorization: Bearer client"),
        {"Authorization": "Bearer node"},
        b"authorization",
        [b"Bearer node"],
        id="replaces-authorization",
    ),
    pytest.param(
        _h("authorization: Bearer client", "authorization: Basic again"),
        {"AUTHORIZATION": "Bearer node"},
        b"authorization",
        [b"Bearer node"],
        id="replaces-every-copy-any-case",
    ),
    pytest.param(
        _h("authorization: Bearer client"),
        {},
        b"authorization",
        [b"Bearer client"],
        id="client-kept-without-node-header",
    ),
    pytest.param(
        _h("accept: */*"),
        {"X-Api-Key": "k"},
        b"x-api-key",
        [b"k"],
        id="added",
    ),
    pytest.param(
        _h("host: proxy.test"),
        {"Host": "api.internal"},
        b"host",
        [b"api.internal"],
        id="replaces-the-node-host",
    ),
    pytest.param(
        [], {"X-Forwarded-Proto": "https"}, b"x-forwarded-proto", [b"https"], id="sets-proto"
    ),
    pytest.param(
        _h("x-forwarded-for: 1.1.1.1"),
        {"X-Forwarded-For": "203.0.113.1"},
        b"x-forwarded-for",
        [b"203.0.113.1"],
        id="sets-forwarded-for",
    ),
    pytest.param(
        [], {"X-Request-Id": "fixed"}, b"x-request-id", [b"wid-1"], id="not-the-workload-id"
    ),
    pytest.param([], {"Content-Length": "1"}, b"content-length", [b"12"], id="not-the-length"),
    pytest.param([], {"Transfer-Encoding": "chunked"}, b"transfer-encoding", [], id="not-framing"),
    pytest.param([], {"Connection": "close"}, b"connection", [], id="not-connection"),
    pytest.param([], {"Keep-Alive": "timeout=1"}, b"keep-alive", [], id="not-hop-by-hop"),
]


@pytest.mark.parametrize(("client", "node_headers", "name", "values"), NODE_HEADERS)
def test_node_headers(
    client: Headers, node_headers: Mapping[str, str], name: bytes, values: list[bytes]
) -> None:
    headers = _upstream(client, node_headers=node_headers)
    assert _values(headers, name) == values
    assert headers[0][0] == b"host"  # first, and only once
    assert len(_values(headers, b"host")) == 1


# -- headers sent back to the client ----------------------------------------------------------

UPSTREAM_RESPONSE = _h(
    "content-type: text/event-stream",
    "content-length: 5",
    "connection: keep-alive, x-hop",
    "keep-alive: timeout=5",
    "x-hop: 1",
    "transfer-encoding: chunked",
    "x-request-id: upstream-id",
    "x-failover-node: spoofed",
    "x-failover-attempts: 9",
    "server: vllm",
    "set-cookie: a=1",
    "set-cookie: b=2",
)


@pytest.mark.parametrize(
    ("upstream", "keep_length", "length"),
    [
        pytest.param(UPSTREAM_RESPONSE, False, [], id="h11-frames"),
        pytest.param(
            [h for h in UPSTREAM_RESPONSE if h[0] != b"transfer-encoding"],
            True,
            [b"5"],
            id="node-length-kept",
        ),
        # RFC 9112 section 6.3: chunked framing wins, the length is removed.
        pytest.param(UPSTREAM_RESPONSE, True, [], id="both-framings-lose-the-length"),
        pytest.param(_h("content-type: text/plain"), True, [], id="no-length-to-keep"),
    ],
)
def test_client_response_headers(upstream: Headers, keep_length: bool, length: list[bytes]) -> None:
    headers = client_response_headers(
        upstream, 200, request_id="wid-1", node="gpu-a", attempts=2, keep_length=keep_length
    )
    body_headers = [(n, v) for n, v in upstream if n in (b"content-type", b"server", b"set-cookie")]
    assert headers == [
        *body_headers,
        *[(b"content-length", value) for value in length],
        (b"x-request-id", b"wid-1"),
        (b"x-failover-node", b"gpu-a"),
        (b"x-failover-attempts", b"2"),
    ]


NODE_LENGTH = _h("content-type: text/plain", "content-length: 5")


@pytest.mark.parametrize(
    ("status", "length"),
    [
        pytest.param(200, [b"5"], id="200"),
        pytest.param(206, [b"5"], id="206"),
        # RFC 9110 section 8.6: a server MUST NOT send Content-Length in a
        # 1xx or 204 response; the node's is dropped, never relayed.
        pytest.param(204, [], id="204-never"),
        pytest.param(100, [], id="1xx-never"),
        pytest.param(199, [], id="1xx-never-199"),
        # A 304 may carry the length its 200 would have had (section 8.6):
        # kept, and no body follows (h11 frames a 304 as empty).
        pytest.param(304, [b"5"], id="304-kept"),
        pytest.param(404, [b"5"], id="404"),
    ],
)
def test_client_response_length_by_status(status: int, length: list[bytes]) -> None:
    headers = client_response_headers(
        NODE_LENGTH, status, request_id="wid-1", node="gpu-a", attempts=1, keep_length=True
    )
    assert _values(headers, b"content-length") == length
    assert _values(headers, b"content-type") == [b"text/plain"]
