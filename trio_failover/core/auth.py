"""Pure: client keys and the admin token (docs/security.md).

Keys are a tuple of ``(name, key)`` pairs in configuration order; an empty
tuple means no key is configured and nothing is checked. A client presents
its key as ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``; the admin
listener takes its token as ``Authorization: Bearer TOKEN`` or a
``token=TOKEN`` query parameter.

Secrets stay secret: every presented value is compared with every key (no
early exit that would tell by its timing which key, or how much of one,
matched), through SHA-256 digests with ``hmac.compare_digest``, so that not
even a key's length shows. Nothing here puts a key, a token or a presented
value into an exception message or a repr.

Use, on the client listener::

    check = check_client(request.headers, keys)
    if not check.allowed:
        answer 401 invalid_api_key (answers.error_headers adds WWW-Authenticate)
    Workload(..., client=check.name)   # None when no key is configured
    upstream = forwarded_headers(request.headers, keys)   # then node headers as before

and on the admin listener, for every route but ``/healthz``::

    if not admin_allowed(request.headers, request.target, token): answer 401
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl

Keys = tuple[tuple[str, str], ...]
Headers = list[tuple[bytes, bytes]]

# Headers that carry a client's key to the proxy; while keys are configured
# they are the proxy's, never a node's.
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key"})


@dataclass(frozen=True, slots=True)
class ClientCheck:
    """Whether a request may go on, and as which client.

    Attributes:
        allowed: False only when keys are configured and none was presented.
        name: the ``NAME`` of the matching key (the workload's ``client``);
            None when no key is configured, or when refused.
    """

    allowed: bool
    name: str | None = None


def _digest(secret: bytes) -> bytes:
    # Equal-length digests: compare_digest leaks the lengths it compares.
    return hashlib.sha256(secret).digest()


def presented_credentials(
    headers: Iterable[tuple[bytes, bytes]], *, api_key_header: bool = True
) -> list[bytes]:
    """Every secret a request presents, in header order.

    Args:
        headers: the request headers (lowercase names).
        api_key_header: also take ``X-Api-Key`` values (the client
            listener does; the admin listener takes only ``Authorization``).
    """
    found: list[bytes] = []
    for name, value in headers:
        if name == b"authorization":
            credential = _bearer(value)
        elif name == b"x-api-key" and api_key_header:
            credential = value.strip() or None
        else:
            continue
        if credential:
            found.append(credential)
    return found


def _bearer(value: bytes) -> bytes | None:
    # RFC 9110 section 11.1: the scheme is case-insensitive; RFC 6750 allows
    # one or more spaces before the token.
    scheme, _, credential = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credential.strip() or None


def _match(presented: Iterable[bytes], secrets: Iterable[bytes]) -> int | None:
    """The index of the first of ``secrets`` equal to any presented value.

    Every pair is compared; the loop never stops early.
    """
    digests = [_digest(value) for value in presented]
    found: int | None = None
    for index, secret in enumerate(secrets):
        expected = _digest(secret)
        hit = False
        for digest in digests:
            hit |= hmac.compare_digest(digest, expected)
        if hit and found is None:
            found = index
    return found


def check_client(headers: Iterable[tuple[bytes, bytes]], keys: Keys) -> ClientCheck:
    """Which client a request authenticates as.

    Args:
        headers: the request headers as h11 gives them (lowercase names).
        keys: ``(name, key)`` pairs; empty when no key is configured. A key
            is compared as its UTF-8 bytes.

    Returns:
        ``ClientCheck(True, None)`` with no keys; ``ClientCheck(True, name)``
        for the first configured key presented; else ``ClientCheck(False)``.
    """
    if not keys:
        return ClientCheck(allowed=True)
    index = _match(presented_credentials(headers), (key.encode() for _, key in keys))
    if index is None:
        return ClientCheck(allowed=False)
    return ClientCheck(allowed=True, name=keys[index][0])


def forwarded_headers(headers: Iterable[tuple[bytes, bytes]], keys: Keys) -> Headers:
    """The client's headers as they may go on to a node.

    While keys are configured, ``Authorization`` and ``X-Api-Key`` are the
    proxy's credentials and are removed; with none configured they pass
    unchanged (engines with their own ``--api-key`` rely on the client's).
    A node's own configured ``headers`` are applied afterwards, as before.
    """
    if not keys:
        return list(headers)
    return [(name, value) for name, value in headers if name not in CREDENTIAL_HEADERS]


def admin_allowed(headers: Iterable[tuple[bytes, bytes]], target: bytes, token: str | None) -> bool:
    """Whether an admin request carries the admin token.

    Args:
        headers: the request headers (lowercase names).
        target: the request target as received (path and query); the
            token may be given as a (percent-encoded) ``token=`` parameter.
        token: the configured token; None means no token is required.
    """
    if token is None:
        return True
    presented = presented_credentials(headers, api_key_header=False)
    _, _, query = target.partition(b"?")
    if query:
        for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
            if name == "token" and value:
                presented.append(value.encode())
    return _match(presented, [token.encode()]) is not None
