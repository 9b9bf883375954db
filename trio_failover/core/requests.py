"""Pure: the request as parsed, and as each node gets it (docs/failover.md).

The facts of a client request that its handling depends on:

- ``request_document``: the JSON object of a request body, if it is one;
  ``request_model``, its model;
- ``is_unstreamed``: whether the node will send its head only once the whole
  answer is done (then ``--unstreamed-timeout`` replaces the response-header
  timeout for the wait);
- ``is_list_route``: whether the proxy answers it itself, from the fleet's
  lists (``GET /v1/models``, ``GET /api/tags``);
- ``workload_id``: the client's own ``X-Request-Id`` when acceptable, else a
  new canonical version-4 UUID;
- ``request_line_path``: the path of a raw head's request line, for the
  error answer to a head that h11 never parsed.

And what one node gets of it: ``node_body`` keeps the client's bytes
unless the node calls the model by another name; ``node_target`` drops an
absolute-form's scheme and authority and adds the node's base path. The
headers are ``headers.upstream_request_headers``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from typing import Any

from .config import Upstream
from .names import node_model_name

# The client's id is passed on unchanged when it is this: no
# spaces, quotes or control bytes that could break a log line or a node's
# header parser.
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


# A request line (RFC 9112 section 3) with an origin-form target: method
# token, one space, a target of visible ASCII, one space, the version.
_REQUEST_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ (/[!-~]*) HTTP/[0-9]\.[0-9]\r\n")


def request_line_path(head: bytes | bytearray) -> str:
    """The path (no query) of the request line that begins ``head``; "" if malformed.

    For the error answer to a request refused before h11 parsed it (a bad
    header, a head too large or too slow): the shape of the error depends on
    the path (``answers.error_document``), and a well-formed request line
    names it even when the rest of the head is bad.
    """
    match = _REQUEST_LINE.match(head)
    if match is None:
        return ""
    return match.group(1).partition(b"?")[0].decode("ascii")


def is_ollama_path(path: str) -> bool:
    """Whether ``path`` (no query) is under ``/api/``, Ollama's native API."""
    return path.startswith("/api/")


def request_document(body: bytes) -> object | None:
    """The parsed JSON of a request body that is a JSON object, else None.

    Never raises: bad JSON, bad UTF-8 and absurd nesting all give None.
    """
    if body.lstrip()[:1] != b"{":
        return None  # cheap: no parse for form posts, uploads, empty bodies
    try:
        document: object = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return document


def request_model(document: object) -> str | None:
    """The ``"model"`` of a request document, when it is a string."""
    if isinstance(document, dict):
        model = document.get("model")
        if isinstance(model, str):
            return model
    return None


def is_unstreamed(path: str, document: object) -> bool:
    """Whether the node answers ``document`` only when the whole generation is done.

    Args:
        path: the request path, without the query.
        document: the parsed request body (``request_document``), or None.

    Returns:
        True for a JSON object whose ``"stream"`` is ``false``, or, outside
        ``/api/``, is anything but JSON ``true`` (OpenAI-style APIs answer
        whole by default; Ollama's native API streams unless told not to).
        False without a JSON object body: such a request keeps the
        response-header timeout.
    """
    if not isinstance(document, dict):
        return False
    stream = document.get("stream")
    if stream is False:
        return True
    if is_ollama_path(path):
        return False
    # Only JSON true streams: a "stream": 1 that a lenient engine may take as
    # true only gets the longer deadline, the safe side.
    return stream is not True


MODELS_PATH = b"/v1/models"
TAGS_PATH = b"/api/tags"


def is_list_route(method: bytes, target: bytes) -> bool:
    """Whether the proxy answers this request itself (``GET /v1/models``, ``/api/tags``)."""
    if method != b"GET":
        return False
    return target.split(b"?", 1)[0] in (MODELS_PATH, TAGS_PATH)


def client_workload_id(value: bytes | None) -> str | None:
    """The client's ``X-Request-Id`` value when it is 1-128 of ``[A-Za-z0-9._:-]``."""
    # fullmatch: with match() and "$", a trailing newline would pass.
    if value is not None and _CLIENT_ID.fullmatch(value):
        return value.decode("ascii")
    return None


# Version 4 (bits 76-79 = 0100) and the RFC 9562 variant (bits 62-63 = 10).
_KEEP = ((1 << 128) - 1) & ~(0xF << 76) & ~(0x3 << 62)
_SET = (0x4 << 76) | (0x2 << 62)


def new_workload_id() -> str:
    """A new random version-4 UUID in canonical form (``8-4-4-4-12`` lowercase hex).

    Some engines (llama-cpp-python's request-id middleware among them) refuse
    any other id with a ``400``. The bits come from ``random``, not
    ``secrets``: an id is not a secret (a client may choose its own), and
    ``secrets``/``uuid.uuid4`` make a system call per request, which the
    seeded Mersenne Twister avoids; ``random`` is reseeded in a forked child,
    so two processes do not share a sequence. 122 random bits make a clash
    practically impossible.
    """
    return uuid4_text(random.getrandbits(128))


def uuid4_text(bits: int) -> str:
    """The canonical text of the version-4 UUID made from 128 random ``bits``.

    The same as ``str(uuid.UUID(int=bits, version=4))`` in under half the time.
    """
    digits = f"{bits & _KEEP | _SET:032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def workload_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The workload id: the client's ``X-Request-Id`` (its first) if valid, else a new one.

    Args:
        headers: the request headers as h11 gives them (lowercase names).
    """
    for name, value in headers:
        if name == b"x-request-id":
            return client_workload_id(value) or new_workload_id()
    return new_workload_id()


def node_body(body: bytes, document: Any, node: Upstream) -> bytes:
    """The body for ``node``: its own name of the model, the rest as the client sent it.

    The client's name is kept unless the node's ``models`` mapping gives
    another (``names.node_model_name``: ``llama3.2`` and ``llama3.2:latest``
    find the same key), so an unmapped node gets the client's bytes as sent.
    """
    model = request_model(document)
    if model is not None and node.models is not None:
        node_model = node_model_name(model, node.models)
        if node_model != model:
            return json.dumps({**document, "model": node_model}).encode()
    return body


def node_target(target: bytes, base_path: str) -> bytes:
    """The request target for a node: origin-form, below the node's base path."""
    if target[:1] != b"/":  # absolute-form: keep the path and query only
        target = b"/" + target.split(b"://", 1)[-1].partition(b"/")[2]
    if base_path:
        target = base_path.encode() + target
    return target
