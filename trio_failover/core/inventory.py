"""Pure: inventories, health checks and the fleet-wide model lists (docs/discovery.md).

The discovery loop of the shell checks each node on its own schedule
(``checks.py``: the questions of a check, ``/health`` first, and when the
next one begins) and hands the ``/v1/models`` answer here; what a node is
a candidate for, whether that answer makes it down or ready, and what the
two list routes answer are decided from plain data:

- a node's ``configured`` models, as in its configuration: None, a list of
  names, or a mapping of the client's name to the node's name where ``"*"``
  maps every other name;
- its ``inventory``: the ids of its last good model list, or None while
  unknown (never listed, an empty list, or a last answer that was not a
  model list).

Node names are str, bodies bytes, times float seconds from the shell's clock.

Use, in the shell (docs/discovery.md, "Inventories and routing" and "The
fleet's lists on the client listener"): ``ranking.model_filter`` narrows
the candidates by inventory (``lists_model``); discovery applies
``judge_check`` to the check's ``/v1/models`` answer; a pre-commit ``404``
with ``is_model_not_found`` fails over without cooldown and asks for a
re-check; ``GET /v1/models`` answers ``models_document`` of the nodes'
``advertised_ids``, and ``GET /api/tags`` ``tags_document`` (None: 502).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from .names import WILDCARD, Configured, configured_names, find_name, model_key
from .outcome import error_field

DOWN_REASON = "health_check"  # the reason of a node event and of /status
READY_REASON_CHECK = "health_check"
READY_REASON_SERVED = "success"  # as a committed attempt ending a cooldown
CHECK_PATH = "/v1/models"
CHECK_ANSWER_TIMEOUT = 10.0  # each question of a check: connection made to whole answer read
MAX_LISTING_BYTES = 1 << 20  # a longer answer is not a model list
MAX_NOT_FOUND_BODY = 65536  # as much of a 404 as is worth reading

Inventory = Collection[str] | None


# -- model lists ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listing:
    """A parsed ``GET /v1/models`` answer body.

    Attributes:
        ids: the ``data[].id`` values in order, each once (``()`` for an empty
            list); None when the body is not a model list.
        error: why it is not a model list ("" when it is), for ``last_error``.
    """

    ids: tuple[str, ...] | None
    error: str = ""


def parse_model_list(body: bytes) -> Listing:
    """Parse an OpenAI-style model list; never raises.

    ``"data": null`` counts as an empty list (Ollama sends it with no model).
    """
    if len(body) > MAX_LISTING_BYTES:
        return Listing(None, f"not a model list: larger than {MAX_LISTING_BYTES} bytes")
    try:
        document = json.loads(body)
    except UnicodeDecodeError:
        return Listing(None, "not a model list: not UTF-8 text")
    except (ValueError, RecursionError):
        return Listing(None, "not a model list: not JSON")
    if not isinstance(document, dict):
        return Listing(None, f"not a model list: a JSON {_kind(document)}, not an object")
    data = document.get("data", False)  # False: missing, told from null
    if data is None:
        data = []
    if not isinstance(data, list):
        return Listing(None, 'not a model list: no "data" list')
    ids: dict[str, None] = {}  # ordered and unique
    for index, item in enumerate(data):
        model = item.get("id") if isinstance(item, dict) else None
        if not isinstance(model, str) or not model:
            return Listing(None, f'not a model list: data[{index}] has no "id" string')
        ids[model] = None
    return Listing(tuple(ids))


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"


def inventory_of(ids: Sequence[str] | None) -> tuple[str, ...] | None:
    """The inventory a listing gives: None for no listing or an empty one."""
    return tuple(ids) if ids else None


# -- candidates --------------------------------------------------------------------


def lists_model(model: str, configured: Configured, inventory: Inventory) -> bool:
    """Whether a node *lists* ``model``: it is one of its ``advertised_ids``.

    The names it lists are the ones the fleet's ``/v1/models`` shows for it;
    ``"*"`` lists nothing (it accepts every name, as a single-model engine
    does). Names compare as Ollama resolves them (``names.find_name``).
    """
    ids = advertised_ids(configured, inventory)
    return ids is not None and find_name(model, ids) is not None


def advertised_ids(configured: Configured, inventory: Inventory) -> tuple[str, ...] | None:
    """The model ids a client may ask this node for (``/status`` ``models``).

    The keys of a mapping other than ``"*"``, the entries of a list, else
    the inventory: also for a mapping of ``"*"`` alone, which names no id of
    its own. None when neither is known: then the fleet's
    ``/v1/models`` asks the node live.
    """
    if configured is not None:
        names = configured_names(configured)
        named = tuple(dict.fromkeys(name for name in names if name != WILDCARD))
        if named or WILDCARD not in names:
            return named
    if inventory:
        return tuple(inventory)
    return None


def needs_live_listing(configured: Configured, inventory: Inventory) -> bool:
    """Whether the fleet's ``/v1/models`` must ask this node when it is built."""
    return advertised_ids(configured, inventory) is None


def is_model_not_found(status: int, body: bytes) -> bool:
    """Whether a node's answer says the model is unknown to it (a stale inventory).

    True for a ``404`` whose JSON body (at most ``MAX_NOT_FOUND_BODY``
    bytes) has ``error.code == "model_not_found"`` (OpenAI) or an ``error``
    string that starts with ``model `` and contains ``not found`` (Ollama's
    ``model 'x' not found``). Never raises.
    """
    if status != 404 or len(body) > MAX_NOT_FOUND_BODY:
        return False
    error = error_field(body)
    if isinstance(error, dict):
        return error.get("code") == "model_not_found"
    if isinstance(error, str):
        text = error.lower()
        return text.startswith("model ") and "not found" in text
    return False


# -- health ---------------------------------------------------------------------------


class CheckFailure(enum.StrEnum):
    """A check that got no answer (or one that is not HTTP)."""

    CONNECT_FAILED = "connect_failed"  # refused, unreachable, TLS, reset or closed early
    TIMED_OUT = "timed_out"  # connect timeout, or no whole answer in time
    NOT_HTTP = "not_http"  # the node answered, but not in HTTP/1.1: "any other answer"


class Health(enum.StrEnum):
    """What a check or a served request does to a node's health."""

    READY = "ready"
    DOWN = "down"
    UNCHANGED = "unchanged"


@dataclass(frozen=True, slots=True)
class CheckVerdict:
    """What one finished check means for its node.

    Attributes:
        health: the node's health from now (UNCHANGED: leave it as it is).
        reason: the reason to show with a new health (None with UNCHANGED).
        replace_inventory: whether ``inventory`` replaces the node's one.
        inventory: the new inventory when replaced (None: unknown).
        last_error: the node's new ``last_error``; None leaves it as is.
        result: a short label for the checks metric and logs.
    """

    health: Health
    reason: str | None
    replace_inventory: bool
    inventory: tuple[str, ...] | None
    last_error: str | None
    result: str


def judge_check(
    *,
    failure: CheckFailure | None = None,
    status: int | None = None,
    body: bytes = b"",
    streaming: bool = False,
    detail: str = "",
    health_route: bool = False,
) -> CheckVerdict:
    """Decide what a check's ``GET /v1/models`` answer means.

    Args:
        failure: set when the question got no answer.
        status: the answer's status (when ``failure`` is None).
        body: the answer's body, read up to ``MAX_LISTING_BYTES + 1`` bytes.
        streaming: an attempt of this proxy at this node relayed bytes
            while the question was out; then a timeout is no sign of death
            (the node is busy).
        detail: the shell's words for the failure (no secrets), for
            ``last_error``.
        health_route: the node answered ``GET /health`` with a ``2xx`` just
            before (``checks.judge_health``): it is ready, and this answer
            gives the inventory alone. False: the node has no health route,
            and this answer gives its health too.

    Returns:
        Ready with the listed inventory on a 2xx model list (an empty one:
        inventory unknown). The inventory unknown, with the reason in
        ``last_error``, on any other answer (a 4xx, a body that is not a
        model list, one that is not HTTP): health ready with a health
        route, else left alone. No answer (cannot connect, timed out) or a
        5xx keeps the inventory (a node's models do not change by going
        away): with a health route the node stays ready (result
        ``models_...``); without, it is down, except for a timeout while
        streaming, which changes nothing.

    Raises:
        ValueError: neither ``failure`` nor ``status`` was given.
    """
    suffix = f" ({detail})" if detail else ""
    answered = Health.READY if health_route else Health.UNCHANGED
    reason = READY_REASON_CHECK if health_route else None
    if failure is CheckFailure.NOT_HTTP:
        error = f"health check: {CHECK_PATH} answer is not HTTP/1.1{suffix}"
        return CheckVerdict(answered, reason, True, None, error, "bad_answer")
    if failure is not None:
        words = "timed out" if failure is CheckFailure.TIMED_OUT else "cannot connect"
        if health_route:
            error = f"health check: {CHECK_PATH} {words}{suffix}"
            return CheckVerdict(answered, reason, False, None, error, f"models_{failure}")
        if failure is CheckFailure.TIMED_OUT and streaming:
            return CheckVerdict(
                Health.UNCHANGED, None, False, None, None, "timeout_while_streaming"
            )
        if failure is CheckFailure.TIMED_OUT:
            return _down(f"health check: {CHECK_PATH} timed out{suffix}", str(failure))
        return _down(f"health check {words}{suffix}", str(failure))
    if status is None:
        raise ValueError("judge_check needs a failure or a status")
    if status >= 500:
        error = f"health check: {CHECK_PATH} answered {status}{suffix}"
        if health_route:
            return CheckVerdict(answered, reason, False, None, error, "models_server_error")
        return _down(error, "server_error")
    if 200 <= status < 300:
        listing = parse_model_list(body)
        if listing.ids is not None:
            inventory = inventory_of(listing.ids)
            return CheckVerdict(Health.READY, READY_REASON_CHECK, True, inventory, None, "ok")
        error = f"health check: {CHECK_PATH} answered {status}, {listing.error}"
        return CheckVerdict(answered, reason, True, None, error, "bad_body")
    error = f"health check: {CHECK_PATH} answered {status}{suffix}"
    return CheckVerdict(answered, reason, True, None, error, "bad_status")


def _down(error: str, result: str) -> CheckVerdict:
    return CheckVerdict(Health.DOWN, DOWN_REASON, False, None, error, result)


# -- the fleet-wide lists ---------------------------------------------------------


def models_document(
    nodes: Iterable[tuple[str, Sequence[str] | None]], *, owned_by: str = "trio-failover"
) -> dict[str, object] | None:
    """The fleet's ``GET /v1/models`` answer.

    Args:
        nodes: ``(name, ids)`` in ranking order; ``ids`` from
            ``advertised_ids``, or for a node asked live the ``ids`` of
            ``parse_model_list`` of its answer; None for a node that could
            not be asked or gave no model list (it is left out).
        owned_by: the ``owned_by`` of every entry.

    Returns:
        ``{"object": "list", "data": [{"id", "object": "model", "created",
        "owned_by", "nodes"}]}``, each model once (in order of first
        appearance, as first spelled: ``NAME`` and ``NAME:latest`` are one)
        with its nodes in ranking order; None when no node answered (502).
    """
    # By model_key: "llama3" and "llama3:latest" are one model, shown as
    # first spelled, as routing treats them (names.py).
    shown: dict[str, str] = {}
    serving: dict[str, list[str]] = {}
    answered = False
    for name, ids in nodes:
        if ids is None:
            continue
        answered = True
        for model in ids:
            key = model_key(model)
            names = serving.setdefault(key, [])
            shown.setdefault(key, model)
            if name not in names:
                names.append(name)
    if not answered:
        return None
    data = [
        # "created" (0) only because strict OpenAI clients want the field.
        {"id": shown[key], "object": "model", "created": 0, "owned_by": owned_by, "nodes": names}
        for key, names in serving.items()
    ]
    return {"object": "list", "data": data}


def tags_document(bodies: Iterable[bytes | None]) -> dict[str, object] | None:
    """The fleet's ``GET /api/tags`` answer, merged from the nodes' answers.

    Args:
        bodies: each node's ``/api/tags`` body in ranking order; None for a
            node that did not answer ``2xx`` in time.

    Returns:
        ``{"models": [...]}`` with one entry per model (``names.model_key`` of
        its ``name``; the first node's entry wins, as the node sent it);
        None when no node gave an Ollama tags answer (502).
    """
    merged: dict[str, object] = {}
    answered = False
    for body in bodies:
        entries = tags_entries(body)
        if entries is None:
            continue
        answered = True
        for entry in entries:
            name = entry.get("name", entry.get("model"))
            if isinstance(name, str):
                merged.setdefault(model_key(name), entry)
    return {"models": list(merged.values())} if answered else None


def tags_entries(body: bytes | None) -> list[dict[str, object]] | None:
    """The entries of an Ollama ``/api/tags`` body (``null``: none); None when it is not one."""
    if body is None or len(body) > MAX_LISTING_BYTES:
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    models = document.get("models", False)  # False: missing, told from null
    if models is None:
        return []  # Ollama with nothing pulled may send null
    if not isinstance(models, list):
        return None
    return [entry for entry in models if isinstance(entry, dict)]
