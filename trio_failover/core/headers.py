"""Pure: which headers cross the proxy, and which the proxy adds.

Headers are h11's form: a list of ``(name, value)`` byte pairs with lower-case
names. Hop-by-hop headers (RFC 9110 section 7.6.1) describe one connection
and never cross the proxy in either direction, nor do the headers a message
names in its own ``Connection`` header. Framing (``Content-Length``,
``Transfer-Encoding``) is dropped too: h11 frames each side itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
FRAMING = frozenset({b"content-length", b"transfer-encoding"})
# Headers the proxy itself sets on the way up or down; a client's copy of
# these is replaced, never doubled.
PROXY_OWNED_UP = frozenset(
    {b"host", b"x-forwarded-for", b"x-forwarded-proto", b"x-request-id", b"x-failover-node"}
)
PROXY_OWNED_DOWN = frozenset({b"x-request-id", b"x-failover-node", b"x-failover-attempts"})
# Headers a node's configuration may not set: they describe one connection
# or the framing of one message, or carry the workload id.
NODE_RESERVED = HOP_BY_HOP | FRAMING | frozenset({b"x-request-id"})
# W3C Trace Context (https://www.w3.org/TR/trace-context/): with traces on,
# the node gets the attempt's own, in place of the client's.
TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in ``Connection`` (they are hop-by-hop for this message)."""
    names: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            names.update(token.strip().lower() for token in value.split(b","))
    return frozenset(names)


_never_forwarded: dict[frozenset[bytes], frozenset[bytes]] = {}


def end_to_end(headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]) -> Headers:
    """The headers that may be forwarded: no hop-by-hop, framing or ``drop`` names."""
    # One pass, with the excluded names as one set (made once per ``drop``).
    excluded = _never_forwarded.get(drop)
    if excluded is None:
        excluded = _never_forwarded[drop] = HOP_BY_HOP | FRAMING | drop
    kept = []
    listed: list[bytes] = []
    for name, value in headers:
        if name in excluded:
            if name == b"connection":
                listed.append(value)
        else:
            kept.append((name, value))
    if listed:  # names a Connection header lists are hop-by-hop too
        tokens = connection_tokens((b"connection", value) for value in listed)
        kept = [(name, value) for name, value in kept if name not in tokens]
    return kept


def get(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), if present."""
    for key, value in headers:
        if key == name:
            return value
    return None


def upstream_request_headers(
    client_headers: Sequence[tuple[bytes, bytes]],
    *,
    host: str,
    request_id: str,
    client_address: str | None,
    client_scheme: str,
    node_headers: Mapping[str, str],
    content_length: int | None,
) -> Headers:
    """The headers of the request one node receives.

    The node's configured headers replace headers of the same name, matched
    case-insensitively: the client's (a node key replaces the client's
    ``Authorization``, never doubles it) and the proxy's own ``Host`` and
    ``X-Forwarded-*``. Configured hop-by-hop, framing and ``X-Request-Id``
    headers are ignored: the connection, h11 and the workload id own those.
    ``X-Forwarded-For`` extends the client's chain (all its field lines).
    """
    configured: Headers = []
    overridden: frozenset[bytes] = frozenset()
    drop = PROXY_OWNED_UP  # the same set each time: end_to_end keeps its union
    if node_headers:  # most nodes have none: no lists and sets to build per request
        configured = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in node_headers.items()
        ]
        configured = [(name, value) for name, value in configured if name not in NODE_RESERVED]
        overridden = frozenset(name for name, _ in configured)
        drop = PROXY_OWNED_UP | overridden
    # Host first (RFC 9112 section 3.2), and only once: two Host fields make
    # a server answer 400.
    headers: Headers = [(b"host", get(configured, b"host") or host.encode("ascii"))]
    headers += end_to_end(client_headers, drop)
    if configured:
        headers += [(name, value) for name, value in configured if name != b"host"]
    if b"x-forwarded-for" not in overridden:
        chain = b", ".join(value for name, value in client_headers if name == b"x-forwarded-for")
        if client_address is not None:
            address = client_address.encode("ascii")
            chain = chain + b", " + address if chain else address
        if chain:
            headers.append((b"x-forwarded-for", chain))
    if b"x-forwarded-proto" not in overridden:
        headers.append((b"x-forwarded-proto", client_scheme.encode("ascii")))
    headers.append((b"x-request-id", request_id.encode("ascii")))
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode("ascii")))
    return headers


def with_trace_context(headers: Headers, fields: Mapping[str, str]) -> Headers:
    """``headers`` with their W3C trace context replaced by ``fields``.

    ``fields`` holds ``traceparent`` (and ``tracestate``, if any) as the
    tracing SDK wrote them; a ``traceparent`` or ``tracestate`` already in
    ``headers`` (the client's) is dropped, never doubled.
    """
    kept = [(name, value) for name, value in headers if name not in TRACE_CONTEXT]
    kept += [
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in fields.items()
    ]
    return kept


def may_carry_length(status: int) -> bool:
    """Whether a response with ``status`` may carry a ``Content-Length``.

    RFC 9110 section 8.6: never a 1xx or a 204. A 304 may (the length its
    200 would have had); its body is empty all the same, as h11 frames it.
    """
    return status >= 200 and status != 204


def client_response_headers(
    upstream_headers: Sequence[tuple[bytes, bytes]],
    status: int,
    *,
    request_id: str,
    node: str,
    attempts: int,
    keep_length: bool,
) -> Headers:
    """The headers the client receives with a node's response.

    ``keep_length`` keeps the node's ``Content-Length`` (the whole body will
    be relayed); otherwise h11 frames the body (chunked for HTTP/1.1). An
    answer with a ``Transfer-Encoding`` as well was framed by its chunks
    (h11 reads it so), and its ``Content-Length`` is dropped: RFC 9112
    section 6.3 says a proxy must remove it, and relayed next to a body of
    another length it would be a lie that h11 refuses to send. A ``204``
    (or a ``1xx``) never carries one, whatever the node sent
    (``may_carry_length``).
    """
    headers = end_to_end(upstream_headers, PROXY_OWNED_DOWN)
    if keep_length and may_carry_length(status):
        length = get(upstream_headers, b"content-length")
        if length is not None and get(upstream_headers, b"transfer-encoding") is None:
            headers.append((b"content-length", length))
    headers += [
        (b"x-request-id", request_id.encode("ascii")),
        (b"x-failover-node", node.encode("ascii")),
        (b"x-failover-attempts", str(attempts).encode("ascii")),
    ]
    return headers
