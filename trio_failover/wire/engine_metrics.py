"""The engines' answers to signals, read into ``Signals``; vLLM's Prometheus text here.

The core parses every JSON answer itself (``core/engine_parsers.py``). vLLM
answers in the Prometheus text format, and the parser of prometheus_client
(already a dependency, for our own ``/metrics``) is the well-kept one; it
cannot live in the core, whose modules import nothing that brings sockets or
threads (``prometheus_client.parser`` loads the client's package, and with it
its HTTP exposition). So the text is split into samples here, and the core
judges the samples. Like the core's parsers, nothing here raises on a bad
answer: it gives ``Signals`` with a ``last_error``.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from ..core.engine_parsers import (
    VLLM_SERIES,
    MetricSample,
    llama_props,
    llama_slots,
    lmstudio_models,
    metrics_text,
    ollama_ps,
    vllm_signals,
)
from ..core.engines import SIGNAL_PATHS, Answer, EngineKind, Signals, failed, merge_signals


def prometheus_samples(text: str) -> tuple[list[MetricSample], str]:
    """The samples of vLLM's series in Prometheus ``text``, or [] and why not.

    Only the series ``VLLM_SERIES`` names are kept: a vLLM ``/metrics`` also
    holds histograms by the hundred, which nothing here reads.
    """
    samples: list[MetricSample] = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in VLLM_SERIES:
                    samples.append(MetricSample(sample.name, dict(sample.labels), sample.value))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        # The parser raises ValueError for a bad line, and has been seen to
        # let an IndexError out on truncated input; either way: not metrics.
        return [], f"GET /metrics: not Prometheus text ({exc})"
    return samples, ""


def vllm_metrics(answer: Answer) -> Signals:
    """vLLM ``GET /metrics``: running, waiting and KV-cache usage per ``model_name``."""
    text, error = metrics_text(answer)
    if error:
        return failed(error)
    samples, error = prometheus_samples(text)
    if error:
        return failed(error)
    return vllm_signals(samples)


_PARSERS = {
    "/slots": llama_slots,
    "/props": llama_props,
    "/metrics": vllm_metrics,
    "/api/ps": ollama_ps,
    "/api/v0/models": lmstudio_models,
}


def read_signals(kind: EngineKind, answers: Mapping[str, Answer | str]) -> Signals:
    """One reading of engine ``kind`` from its answers to ``SIGNAL_PATHS[kind]``.

    Args:
        kind: a detected or configured kind (not ``auto``).
        answers: by path: the answer, or a string saying why the read
            failed (``"connect_failed"``, ``"timeout"``...); a path not in
            the mapping was not read.

    Returns:
        The merged reading; ``UNKNOWN``-like (nothing set) for ``openai``.
    """
    parts: list[Signals] = []
    for path in SIGNAL_PATHS.get(kind, ()):
        answer = answers.get(path)
        if answer is None:
            continue
        if isinstance(answer, str):
            parts.append(failed(f"GET {path}: {answer}"))
        else:
            parts.append(_PARSERS[path](answer))
    return merge_signals(parts)
