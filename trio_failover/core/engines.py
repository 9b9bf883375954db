"""Pure: engine kinds, their detection, and what their signals decide (docs/engines.md).

A node's *engine* says which cheap reads it answers besides the OpenAI API:
llama-server its slots, vLLM its Prometheus gauges, Ollama and LM Studio the
models they hold loaded. The parsers of those answers live in
``engine_parsers.py`` (vLLM's Prometheus text is split into samples outside
the core, by ``wire/engine_metrics.py``); this module holds the records they
produce and the plain decisions made from them:

- ``Detection``: the kind of a node and how it was found (for ``/status``;
  ``engine_parsers.next_detection`` weighs the answers of an ``auto``
  node's first good check, one at a time);
- ``is_fresh`` / ``current_signals``: a reading older than three intervals
  is unknown (``UNKNOWN``), and an unknown signal never excludes a node;
- ``resolve_capacity``: ``auto`` is llama-cpp-python's 1, llama-server's
  last ``total_slots`` (it does not go stale), else 0; a configured number
  wins;
- ``model_loaded``, ``head_timeout``: whether a node holds the model, and
  the cold-start deadline for a node known not to hold it;
- ``cooldown_scope``: which outcomes demote one model of a multi-model
  node, and which the whole node.

The slot ledger (``slots.py``) counts a node full, and loaded, by the
proxy's own count and the engine's, whichever is higher. Times are float
seconds of the shell's clock, handed in as ``now``.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from .errors import ConfigError
from .inventory import CHECK_PATH
from .names import find_name

# -- engine kinds and detection -----------------------------------------------


class EngineKind(enum.StrEnum):
    """The values of ``--engine NAME=KIND``."""

    AUTO = "auto"
    OPENAI = "openai"
    OLLAMA = "ollama"
    LLAMA_SERVER = "llama-server"
    LLAMA_CPP_PYTHON = "llama-cpp-python"
    VLLM = "vllm"
    LMSTUDIO = "lmstudio"


ENGINE_KINDS = tuple(kind.value for kind in EngineKind)


def check_engine_kind(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """``Upstream.engine``'s validator: one of ``ENGINE_KINDS``.

    Raises:
        ConfigError: any other value (option ``engine``).
    """
    if value not in ENGINE_KINDS:
        raise ConfigError("engine", value, "one of " + ", ".join(ENGINE_KINDS))


# The answers that tell the engines apart, in the order detection weighs
# them: the first that shows its engine decides, and nothing after it is
# asked. Each is a GET that touches no model, but one: llama-cpp-python's
# GET /v1/models takes its model's lock (with its default settings, that ends
# a running stream), so detection never asks it (``ASKED_BY_THE_CHECK``): it
# weighs the answer of the node's check, which asks it only while no attempt
# is in flight, and asks /openapi.json (FastAPI's own route, no lock) where
# the check had none. llama-server comes first because its /props is the
# most specific answer (llama-server also serves /metrics with --metrics, but
# as `llamacpp:` series, so the order does not decide that).
DETECTION_PATHS: tuple[tuple[EngineKind, str], ...] = (
    (EngineKind.LLAMA_CPP_PYTHON, CHECK_PATH),
    (EngineKind.LLAMA_SERVER, "/props"),
    (EngineKind.OLLAMA, "/api/version"),
    (EngineKind.VLLM, "/metrics"),
    (EngineKind.LMSTUDIO, "/api/v0/models"),
    (EngineKind.LLAMA_CPP_PYTHON, "/openapi.json"),
)
ASKED_BY_THE_CHECK = frozenset({CHECK_PATH})

# The reads of each engine's signals, every --load-interval.
SIGNAL_PATHS: Mapping[EngineKind, tuple[str, ...]] = {
    # /slots last: the proxy anchors the reading to its own count when the
    # read ends (SlotLedger.note_reading), the closer to the engine's answer
    # the better.
    EngineKind.LLAMA_SERVER: ("/props", "/slots"),
    EngineKind.VLLM: ("/metrics",),
    EngineKind.OLLAMA: ("/api/ps",),
    EngineKind.LMSTUDIO: ("/api/v0/models",),
    # None: it serves one request at a time, and a read that needs its model
    # would end the running one; its capacity is 1 (``resolve_capacity``).
    EngineKind.LLAMA_CPP_PYTHON: (),
    EngineKind.OPENAI: (),
}

SIGNAL_ANSWER_TIMEOUT = 2.0  # each read: the connect timeout, then at most this
MAX_SIGNAL_BYTES = 1 << 20  # a longer answer is not a signal
STALE_AFTER_INTERVALS = 3


@attrs.frozen
class Answer:
    """One answer to one of the proxy's own GETs: status, content type, body."""

    status: int
    content_type: str = ""
    body: bytes = b""


@attrs.frozen
class Detection:
    """An engine kind and where it came from (``/status``'s ``engine_source``)."""

    kind: EngineKind
    found_by: str


@attrs.frozen
class Ask:
    """Detection's next step: ask ``path`` (``engine_parsers.next_detection``)."""

    path: str


def configured_engine(kind: EngineKind) -> Detection | None:
    """The detection of a configured kind: itself, or None for ``auto`` (detect it)."""
    if kind is EngineKind.AUTO:
        return None
    return Detection(kind, "configured")


# -- signals ------------------------------------------------------------------


@attrs.frozen
class ModelLoad:
    """One model's share of a vLLM node (its ``model_name`` label)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None


@attrs.frozen
class LoadedModel:
    """One model Ollama holds loaded now (``GET /api/ps``)."""

    name: str
    expires_at: str | None = None  # RFC 3339, as the engine wrote it
    size_vram: int | None = None


@attrs.frozen(kw_only=True)
class Signals:
    """What a node's engine said at one read; None where it said nothing.

    Attributes:
        busy: requests the engine works on now (llama-server's processing
            slots, vLLM's running requests), whoever sent them.
        waiting: requests queued inside the engine (vLLM).
        total_slots: the engine's own capacity (llama-server ``/props``).
        kv_cache_usage: the fraction of KV cache in use, 0..1 (vLLM; the
            highest of its models).
        per_model: vLLM's numbers by ``model_name``.
        loaded: the models loaded now (Ollama, LM Studio); None when the
            engine does not say.
        not_loaded: models the engine knows but holds unloaded (LM Studio).
            For Ollama every model not in ``loaded`` is not loaded.
        loaded_is_complete: ``loaded`` lists every loaded model, so a model
            absent from it is known not loaded (Ollama's ``/api/ps``).
        loaded_details: Ollama's entries, for ``/status``.
        last_error: why a read gave nothing usable ("" when all went well).
    """

    busy: int | None = None
    waiting: int | None = None
    total_slots: int | None = None
    kv_cache_usage: float | None = None
    per_model: Mapping[str, ModelLoad] = attrs.field(factory=dict)
    loaded: frozenset[str] | None = None
    not_loaded: frozenset[str] = frozenset()
    loaded_is_complete: bool = False
    loaded_details: tuple[LoadedModel, ...] = ()
    last_error: str = ""


UNKNOWN = Signals()


def failed(error: str) -> Signals:
    """A reading that gave nothing but its reason."""
    return Signals(last_error=error)


def merge_signals(parts: Sequence[Signals]) -> Signals:
    """One reading from the answers of several reads (llama-server's two).

    A field set by a later part wins over an earlier one; errors are joined
    with ``"; "`` so that ``last_error`` names every read that failed.
    """
    merged = UNKNOWN
    errors: list[str] = []
    for part in parts:
        changes = {
            field.name: getattr(part, field.name)
            for field in attrs.fields(Signals)
            if getattr(part, field.name) != getattr(UNKNOWN, field.name)
        }
        errors += [changes.pop("last_error")] if "last_error" in changes else []
        merged = attrs.evolve(merged, **changes)
    return attrs.evolve(merged, last_error="; ".join(errors))


def stale_after(load_interval: float, check_interval: float) -> float:
    """How old a reading may be before it is unknown: three intervals.

    With ``--load-interval 0`` signals are read only with each check, so the
    interval that counts is the check's.
    """
    interval = load_interval if load_interval > 0 else check_interval
    return STALE_AFTER_INTERVALS * interval


def is_fresh(read_at: float | None, now: float, max_age: float) -> bool:
    """Whether a reading taken at ``read_at`` still counts at ``now``.

    A reading exactly ``max_age`` old still counts; None (never read) does not.
    """
    return read_at is not None and now - read_at <= max_age


def current_signals(
    signals: Signals | None, read_at: float | None, now: float, max_age: float
) -> Signals:
    """The reading if it is fresh, else ``UNKNOWN`` (which limits nothing)."""
    if signals is None or not is_fresh(read_at, now, max_age):
        return UNKNOWN
    return signals


# -- capacity and load --------------------------------------------------------


@attrs.frozen
class Capacity:
    """A node's capacity and where it came from (for ``check`` and ``/status``)."""

    value: int
    source: str


AUTO_FROM_SLOTS = "auto (GET /props total_slots)"
AUTO_ONE_AT_A_TIME = "auto (llama-cpp-python serves one request at a time)"
AUTO_NONE = "auto (the engine gives none)"

# Engines whose capacity is their nature rather than a number they say:
# llama-cpp-python serves one request at a time (its model's lock) and, with
# its default settings, ends the running stream for the next request, which
# the client sees as a complete answer ("[DONE]") without its tokens.
FIXED_CAPACITY: Mapping[EngineKind, Capacity] = {
    EngineKind.LLAMA_CPP_PYTHON: Capacity(1, AUTO_ONE_AT_A_TIME),
}


def resolve_capacity(
    configured: int | None,
    configured_source: str,
    total_slots: int | None,
    *,
    kind: EngineKind | None = None,
) -> Capacity:
    """Capacity ``auto`` or a configured number.

    Args:
        configured: the configured number, or None for ``auto``.
        configured_source: where the number came from (``--capacity a=2``,
            ``TRIO_FAILOVER_CAPACITY``, the file...); used only when set.
        total_slots: llama-server's last ``total_slots``, or None when it
            never said one. Not a signal that goes stale: a frozen engine's
            slots do not vanish.
        kind: the node's engine, or None while unknown.

    Returns:
        The configured number when there is one (it always wins), else the
        engine kind's own (``FIXED_CAPACITY``: llama-cpp-python 1), else
        ``total_slots`` when the engine gave a positive one, else 0 (no limit).
    """
    if configured is not None:
        return Capacity(configured, configured_source)
    fixed = FIXED_CAPACITY.get(kind) if kind is not None else None
    if fixed is not None:
        return fixed
    if total_slots is not None and total_slots > 0:
        return Capacity(total_slots, AUTO_FROM_SLOTS)
    return Capacity(0, AUTO_NONE)


def capacity_at_start(configured: int | None, engine: str) -> int:
    """A node's capacity before any read of its engine: ``resolve_capacity`` of its configuration.

    Args:
        configured: the node's configured capacity, None for ``auto``.
        engine: its configured engine kind (``auto`` is not known yet).
    """
    return resolve_capacity(configured, "", None, kind=EngineKind(engine)).value


# -- loaded models ------------------------------------------------------------


def model_loaded(signals: Signals, model: str) -> bool | None:
    """Whether the engine holds ``model`` loaded: True, False, or None (unknown)."""
    if signals.loaded is None:
        return None
    if find_name(model, signals.loaded) is not None:
        return True
    if signals.loaded_is_complete or find_name(model, signals.not_loaded) is not None:
        return False
    return None


def needs_cold_start(loaded: bool | None) -> bool:
    """An attempt waits for a model load only where the model is known not loaded."""
    return loaded is False


def head_timeout(
    loaded: bool | None, *, response_header_timeout: float, cold_start_timeout: float
) -> float:
    """The head deadline of an attempt: ``--cold-start-timeout`` for a cold load.

    A cold load is work, not a stall: a node that must load the model gets
    the cold-start timeout *instead of* the header timeout (also when it is
    set shorter). ``0`` turns it off: every attempt gets the header timeout.
    """
    if cold_start_timeout and needs_cold_start(loaded):
        return cold_start_timeout
    return response_header_timeout


# -- per-model cooldowns ------------------------------------------------------


class Scope(enum.StrEnum):
    """What a demotion covers."""

    MODEL = "model"
    NODE = "node"


# On a node serving more than one model, these stall one model
# (its load, its prompt) and say nothing of the others.
PER_MODEL_OUTCOMES = frozenset({"header_timeout", "first_body_timeout"})
PER_MODEL_STATUSES = frozenset({429})
# ...and these say the process itself is gone or stuck. Listed for the
# docs and tests; any outcome in neither set is node-wide as well, as
# every demotion is today.
NODE_WIDE_OUTCOMES = frozenset({"unresponsive", "health_check", "dead_peer", "stream_idle_timeout"})


def cooldown_scope(outcome: str, status: int | None, *, serves_many: bool) -> Scope:
    """Whether a demotion covers one model of the node or the whole node.

    Args:
        outcome: the attempt's outcome (``header_timeout``, ``dead_peer``...,
            ``retryable_response`` for a 429), or ``health_check`` for a
            failed check.
        status: the node's answer status, where there was one.
        serves_many: the node's inventory or configured ``models`` name
            more than one model.
    """
    if not serves_many or outcome in NODE_WIDE_OUTCOMES:
        return Scope.NODE
    if outcome in PER_MODEL_OUTCOMES or status in PER_MODEL_STATUSES:
        return Scope.MODEL
    return Scope.NODE


def serves_many(
    configured: Sequence[str] | Mapping[str, str] | None, inventory: Collection[str] | None
) -> bool:
    """Whether a node serves more than one model: its configured names, else its inventory.

    Args:
        configured: the node's configured ``models`` (a list, or a mapping
            of client names, ``"*"`` meaning any model).
        inventory: the ids of its last model list, or None.
    """
    if isinstance(configured, Mapping):
        return len(configured) > 1 or "*" in configured
    if configured is not None:
        return len(configured) > 1
    return inventory is not None and len(inventory) > 1
