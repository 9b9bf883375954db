"""Pure: the request as one node receives it, from the client's request.

The body keeps the client's bytes unless the node calls the model by
another name; the target loses an absolute-form's scheme and authority and
gains the node's base path. Headers are ``headers.upstream_request_headers``;
the parsed body is ``requests.request_document``'s.
"""

from __future__ import annotations

import json
from typing import Any

from .config import Upstream
from .names import node_model_name
from .requests import request_model


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
