"""Pure: what a proxy must refuse in a request that h11 would let through.

Request smuggling lives on two parsers disagreeing (RFC 9112 sections 2.2,
5.2 and 6.1), so the client side screens each raw head before h11 parses it
(``screen_head``) and each parsed request's body framing (``check_framing``).
"""

from __future__ import annotations

from .errors import ClientError


def screen_head(head: bytes, max_head: int) -> None:
    """Refuse a complete raw head that h11 would accept but a proxy must not.

    Raises:
        ClientError: 431 over ``max_head`` bytes (h11 measures only heads
            still incomplete, so one that crosses the limit and ends in the
            same read would pass); 400 for a bare CR or LF (RFC 9112 section
            2.2 lets a recipient take a lone LF as a line end, the classic way
            to smuggle a header past a stricter parser) or an obs-fold
            (section 5.2: reject it, or unfold it as h11 does silently).
    """
    if len(head) > max_head:
        raise ClientError(431, "request header fields too large", "headers_too_large")
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        raise ClientError(400, "malformed request: bare CR or LF in the head", "bad_request")
    if b"\r\n " in head or b"\r\n\t" in head:
        raise ClientError(400, "malformed request: obsolete line folding", "bad_request")


def check_framing(headers: list[tuple[bytes, bytes]], http_version: bytes) -> None:
    """Refuse a request whose body framing two parsers could read differently.

    RFC 9112 section 6.1: ``Transfer-Encoding`` with ``Content-Length``, or
    in an HTTP/1.0 request, is faulty framing; h11 goes by the
    ``Transfer-Encoding``, a node or another hop may not.

    Raises:
        ClientError: 400.
    """
    names = {name for name, _ in headers}
    if b"transfer-encoding" not in names:
        return
    if b"content-length" in names:
        message = "malformed request: both Transfer-Encoding and Content-Length"
        raise ClientError(400, message, "bad_request")
    if http_version == b"1.0":
        message = "malformed request: Transfer-Encoding in an HTTP/1.0 request"
        raise ClientError(400, message, "bad_request")
