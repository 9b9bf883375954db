"""Pure: the engines' own answers, parsed into ``Signals`` (docs/engines.md); never raises.

One function per read, from an ``Answer`` (status, content type, body) to a
``Signals`` record: a malformed, partial or refused answer gives a record
with nothing but ``last_error``, a sentence that names the read and what was
wrong with it. The shapes are those recorded from llama-server (see
``tests/data/engines/``) and taken from the other engines' source and docs:

- llama-server ``GET /slots``: a JSON list of slots, each with a boolean
  ``is_processing``; ``GET /props``: an object with ``total_slots``;
- vLLM ``GET /metrics``: Prometheus text; its samples are split out by
  ``wire/engine_metrics.py`` (prometheus_client's parser imports the
  client's whole package, sockets and threads with it) and judged here by
  ``vllm_signals``;
- Ollama ``GET /api/ps``: ``{"models": [{"name", "expires_at",
  "size_vram", ...}]}``, every loaded model; ``GET /api/version``:
  ``{"version": ...}``;
- LM Studio ``GET /api/v0/models``: ``{"data": [{"id", "state", ...}]}``
  with ``state`` ``loaded`` or ``not-loaded``;
- llama-cpp-python (detection only) ``GET /v1/models``: ``{"data": [{"id",
  "owned_by": "me", "permissions": []}]}``; ``GET /openapi.json``: FastAPI's
  document, ``info.title`` "🦙 llama.cpp Python API".
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .engines import (
    ASKED_BY_THE_CHECK,
    DETECTION_PATHS,
    MAX_SIGNAL_BYTES,
    Answer,
    Ask,
    Detection,
    EngineKind,
    LoadedModel,
    ModelLoad,
    Signals,
    failed,
)

# -- detection ----------------------------------------------------------------


def next_detection(answers: Mapping[str, Answer | None]) -> Detection | Ask | None:
    """The next step of detecting an ``auto`` node's engine, from the answers so far.

    The paths are weighed in ``DETECTION_PATHS`` order: the first whose
    answer shows its engine decides, so nothing after it is asked; the first
    not asked yet is the next question, unless it is one that only the check
    asks (``ASKED_BY_THE_CHECK``: llama-cpp-python's ``/v1/models``), which
    is skipped when the check had no answer to it.

    Args:
        answers: by path, what was asked so far: the answer, or None where
            the read got none (refused, timed out). The check's
            ``/v1/models`` answer is here from the start where it had one.

    Returns:
        The ``Detection`` once one answer decides, with a ``found_by`` such
        as ``"GET /props: total_slots"``; ``Ask(path)`` for the next
        question; once all are asked, ``openai`` (``"no engine answer"``) if
        any of detection's own questions got an answer, else None: nothing
        decided, try again at the next good check (a node that went away
        meanwhile is not taken for ``openai``).
    """
    for kind, path in DETECTION_PATHS:
        if path not in answers:
            if path in ASKED_BY_THE_CHECK:
                continue
            return Ask(path)
        answer = answers[path]
        evidence = "" if answer is None else looks_like(kind, answer)
        if evidence:
            return Detection(kind, f"GET {path}: {evidence}")
    answered = any(
        answer is not None for path, answer in answers.items() if path not in ASKED_BY_THE_CHECK
    )
    return Detection(EngineKind.OPENAI, "no engine answer") if answered else None


def looks_like(kind: EngineKind, answer: Answer) -> str:
    """What in ``answer`` shows engine ``kind`` ("" when nothing does)."""
    if answer.status != 200 or len(answer.body) > MAX_SIGNAL_BYTES:
        return ""
    if kind is EngineKind.VLLM:
        return "vllm: series" if _has_vllm_series(answer.body) else ""
    document = _loads(answer.body)
    if not isinstance(document, dict):
        return ""
    if kind is EngineKind.LLAMA_SERVER:
        return "total_slots" if _count(document.get("total_slots")) is not None else ""
    if kind is EngineKind.OLLAMA:
        return "version" if isinstance(document.get("version"), str) else ""
    if kind is EngineKind.LMSTUDIO:
        data = document.get("data")
        if isinstance(data, list) and data and all(_has_state(item) for item in data):
            return "state per model"
    if kind is EngineKind.LLAMA_CPP_PYTHON:
        return _llama_cpp_python(document)
    return ""


LLAMA_CPP_PYTHON_TITLE = "llama.cpp Python API"  # its app's title is "🦙 llama.cpp Python API"


def _llama_cpp_python(document: dict[str, object]) -> str:
    """What shows llama-cpp-python: its ``/v1/models`` or its ``/openapi.json``.

    Every model of its list is ``owned_by`` "me" with ``permissions``; its
    OpenAPI document's ``info.title`` names its app.
    """
    data = document.get("data")
    if isinstance(data, list) and data and all(_owned_by_me(item) for item in data):
        return 'owned_by "me" with permissions'
    info = document.get("info")
    title = info.get("title") if isinstance(info, dict) else None
    if isinstance(title, str) and LLAMA_CPP_PYTHON_TITLE in title:
        return f'title "{LLAMA_CPP_PYTHON_TITLE}"'
    return ""


def _owned_by_me(item: object) -> bool:
    return (
        isinstance(item, dict)
        and item.get("owned_by") == "me"
        and isinstance(item.get("permissions"), list)
    )


def _has_vllm_series(body: bytes) -> bool:
    # A sample line, or its TYPE line: vLLM prefixes every series "vllm:".
    for line in body.splitlines():
        stripped = line.lstrip()
        if stripped.startswith((b"vllm:", b"# TYPE vllm:", b"# HELP vllm:")):
            return True
    return False


def _has_state(item: object) -> bool:
    return isinstance(item, dict) and isinstance(item.get("state"), str)


# -- llama-server -------------------------------------------------------------


def llama_slots(answer: Answer) -> Signals:
    """llama-server ``GET /slots``: busy = the slots with ``is_processing`` true."""
    document, error = _json_answer(answer, "/slots")
    if error:
        return failed(error)
    if not isinstance(document, list):
        return failed("GET /slots: not a JSON list of slots")
    busy = 0
    for index, slot in enumerate(document):
        processing = slot.get("is_processing") if isinstance(slot, dict) else None
        if not isinstance(processing, bool):
            return failed(f"GET /slots: slot {index} has no boolean is_processing")
        busy += processing
    return Signals(busy=busy)


def llama_props(answer: Answer) -> Signals:
    """llama-server ``GET /props``: its ``total_slots`` (``--parallel``)."""
    document, error = _json_answer(answer, "/props")
    if error:
        return failed(error)
    slots = _count(document.get("total_slots")) if isinstance(document, dict) else None
    if slots is None:
        return failed("GET /props: no total_slots (a whole number >= 0)")
    return Signals(total_slots=slots)


# -- Ollama -------------------------------------------------------------------


def ollama_ps(answer: Answer) -> Signals:
    """Ollama ``GET /api/ps``: every model loaded now (so the rest are not)."""
    document, error = _json_answer(answer, "/api/ps")
    if error:
        return failed(error)
    if not isinstance(document, dict) or "models" not in document:
        return failed('GET /api/ps: no "models" list')
    entries = document["models"]
    if entries is None:  # a Go nil slice; the handler makes an empty one, but be kind
        entries = []
    if not isinstance(entries, list):
        return failed('GET /api/ps: "models" is not a list')
    models: list[LoadedModel] = []
    for index, entry in enumerate(entries):
        model = _loaded_model(entry)
        if model is None:
            # One bad entry spoils the list: a model missing from a complete
            # list would read as "not loaded" and lose its place.
            return failed(f"GET /api/ps: model {index} has no name")
        models.append(model)
    return Signals(
        loaded=frozenset(model.name for model in models),
        loaded_is_complete=True,
        loaded_details=tuple(models),
    )


def _loaded_model(entry: object) -> LoadedModel | None:
    if not isinstance(entry, dict):
        return None
    name = entry.get("name") or entry.get("model")
    if not isinstance(name, str) or not name:
        return None
    expires = entry.get("expires_at")
    return LoadedModel(
        name=name,
        expires_at=expires if isinstance(expires, str) else None,
        size_vram=_count(entry.get("size_vram")),
    )


# -- LM Studio ----------------------------------------------------------------


def lmstudio_models(answer: Answer) -> Signals:
    """LM Studio ``GET /api/v0/models``: ``loaded`` / ``not-loaded`` per model id.

    Another ``state`` (a later release's ``loading``, say) leaves that model
    unknown rather than failing the whole list.
    """
    document, error = _json_answer(answer, "/api/v0/models")
    if error:
        return failed(error)
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return failed('GET /api/v0/models: no "data" list')
    loaded: set[str] = set()
    not_loaded: set[str] = set()
    for index, item in enumerate(data):
        model = item.get("id") if isinstance(item, dict) else None
        state = item.get("state") if isinstance(item, dict) else None
        if not isinstance(model, str) or not isinstance(state, str):
            return failed(f"GET /api/v0/models: model {index} has no id and state")
        if state == "loaded":
            loaded.add(model)
        elif state == "not-loaded":
            not_loaded.add(model)
    return Signals(loaded=frozenset(loaded), not_loaded=frozenset(not_loaded))


# -- vLLM ---------------------------------------------------------------------


class MetricSample(NamedTuple):
    """One Prometheus sample: series name, labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE = "vllm:kv_cache_usage_perc"
KV_CACHE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM's name before v0.10
VLLM_SERIES = (RUNNING, WAITING, KV_CACHE, KV_CACHE_OLD)


def vllm_signals(samples: Iterable[MetricSample]) -> Signals:
    """vLLM ``GET /metrics``, as samples: running, waiting, KV cache per ``model_name``.

    A node's busy and waiting counts are the sums over its models (and over
    the ``engine`` label of a data-parallel server); its KV-cache usage is
    the highest. ``vllm:kv_cache_usage_perc`` wins over the older
    ``vllm:gpu_cache_usage_perc`` where a release exports both.
    """
    sums: dict[str, dict[str, float]] = {}
    for sample in samples:
        if sample.name not in VLLM_SERIES:
            continue
        if not math.isfinite(sample.value) or sample.value < 0:
            return failed(f"GET /metrics: {sample.name} is {sample.value}")
        model = sample.labels.get("model_name", "")
        per_series = sums.setdefault(model, {})
        if sample.name in (KV_CACHE, KV_CACHE_OLD):
            per_series[sample.name] = max(per_series.get(sample.name, 0.0), sample.value)
        else:
            per_series[sample.name] = per_series.get(sample.name, 0.0) + sample.value
    if not any(RUNNING in series for series in sums.values()):
        return failed(f"GET /metrics: no {RUNNING} series")
    per_model = {model: _model_load(series) for model, series in sums.items() if model}
    loads = list(per_model.values()) or [_model_load(sums.get("", {}))]
    usages = [load.kv_cache_usage for load in loads if load.kv_cache_usage is not None]
    return Signals(
        busy=sum(load.running for load in loads),
        waiting=sum(load.waiting for load in loads),
        kv_cache_usage=max(usages) if usages else None,
        per_model=per_model,
    )


def _model_load(series: Mapping[str, float]) -> ModelLoad:
    usage = series.get(KV_CACHE, series.get(KV_CACHE_OLD))
    return ModelLoad(
        running=round(series.get(RUNNING, 0.0)),
        waiting=round(series.get(WAITING, 0.0)),
        kv_cache_usage=usage,
    )


def metrics_text(answer: Answer) -> tuple[str, str]:
    """The text of a ``GET /metrics`` answer, or "" and why it is not one."""
    if answer.status != 200:
        return "", f"GET /metrics: HTTP {answer.status}"
    if len(answer.body) > MAX_SIGNAL_BYTES:
        return "", f"GET /metrics: more than {MAX_SIGNAL_BYTES} bytes"
    try:
        return answer.body.decode("utf-8"), ""
    except UnicodeDecodeError:
        return "", "GET /metrics: not UTF-8 text"


# -- shared -------------------------------------------------------------------


def _json_answer(answer: Answer, path: str) -> tuple[object, str]:
    """The JSON document of a 200 answer, or None and a ``last_error`` sentence.

    The content type is not insisted on (engines differ, and a proxy in
    between may rewrite it); the body must parse.
    """
    if answer.status != 200:
        return None, f"GET {path}: HTTP {answer.status}"
    if len(answer.body) > MAX_SIGNAL_BYTES:
        return None, f"GET {path}: more than {MAX_SIGNAL_BYTES} bytes"
    document = _loads(answer.body)
    if document is _INVALID:
        return None, f"GET {path}: not JSON"
    return document, ""


_INVALID = object()


def _loads(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return _INVALID


def _count(value: object) -> int | None:
    """A whole number >= 0 (JSON's bools are not numbers here), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value
