"""Pure: the JSON body and extra headers of every error the proxy makes itself.

One vocabulary of ``type`` (OpenAI's ``error.type`` field), by who is at
fault, the values used so far:

- ``invalid_request_error``: a 4xx about the client's request (400, 401,
  404 ``model_not_found``, 408, 413, 431);
- ``upstream_error``: a 5xx, the fleet could not answer (502, 503, 504);
- ``admin_error``: any error of the admin listener.

Outside ``/api/`` the body is OpenAI's shape::

    {"error": {"message", "type", "code"}, "attempts"?}

On ``/api/`` paths it is Ollama's, whose clients show ``error`` as the
message::

    {"error": "message", "code": "...", "attempts"?}

``attempts``, when given, is at the top level in both: once, where both
shapes have it.

Use::

    body = json.dumps(error_document(path, 504, "upstream_timeout", "every node failed",
                                     [record.to_json() for record in attempts]))
    headers = error_headers("upstream_timeout") + content-type, length, ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .requests import is_ollama_path

INVALID_REQUEST = "invalid_request_error"
UPSTREAM = "upstream_error"
ADMIN = "admin_error"

# Codes whose answer carries a header of its own: a 401 names the scheme to
# use (RFC 9110 section 11.6.1), a full or slow queue says when to come back.
_EXTRA_HEADERS: dict[str, list[tuple[bytes, bytes]]] = {
    "invalid_api_key": [(b"www-authenticate", b"Bearer")],
    "invalid_admin_token": [(b"www-authenticate", b"Bearer")],
    "queue_full": [(b"retry-after", b"1")],
    "queue_timeout": [(b"retry-after", b"1")],
    # A drain turns waiting workloads away: another instance, or this one
    # restarted, can take the retry.
    "shutting_down": [(b"retry-after", b"1")],
}


def error_type(status: int, *, admin: bool = False) -> str:
    """The ``error.type`` of an error the proxy makes (see the module docstring)."""
    if admin:
        return ADMIN
    return UPSTREAM if status >= 500 else INVALID_REQUEST


def error_document(
    path: str,
    status: int,
    code: str,
    message: str,
    attempts: Sequence[Mapping[str, object]] | None = None,
    *,
    admin: bool = False,
) -> dict[str, object]:
    """The JSON document of an error answer.

    Args:
        path: the request path (a query, if left on, is ignored); ``/api/...``
            gives Ollama's shape.
        status: the HTTP status of the answer.
        code: the machine-readable code (``model_not_found``, ...).
        message: for humans; never a key, a token or a header line.
        attempts: the ``{"node", "outcome", "elapsed_ms"}`` records of
            the attempts (``AttemptRecord.to_json()``); None leaves the field
            out, an empty list sends ``[]``.
        admin: the error is the admin listener's (always OpenAI's shape).

    Returns:
        A fresh dict, ready for ``json.dumps``.
    """
    if not admin and is_ollama_path(path.partition("?")[0]):
        document: dict[str, object] = {"error": message, "code": code}
        if attempts is not None:
            document["attempts"] = list(attempts)
        return document
    error: dict[str, object] = {
        "message": message,
        "type": error_type(status, admin=admin),
        "code": code,
    }
    document = {"error": error}
    if attempts is not None:
        document["attempts"] = list(attempts)
    return document


def error_headers(code: str) -> list[tuple[bytes, bytes]]:
    """Headers an error answer needs beyond Content-Type and framing (a fresh list).

    ``401 invalid_api_key`` and ``invalid_admin_token`` get
    ``WWW-Authenticate: Bearer``; ``503 queue_full``, ``queue_timeout`` and
    ``shutting_down`` get ``Retry-After: 1``.
    """
    return list(_EXTRA_HEADERS.get(code, ()))
