"""Pure: the tokens of an answer, as the engine reported them (docs/observability.md).

Engines tell an answer's tokens in its last bytes, never in its head:

- an unstreamed OpenAI answer: ``"usage": {"prompt_tokens", "completion_tokens"}``
  (llama-server, llama-cpp-python, vLLM, Ollama's ``/v1``);
- an OpenAI event stream: its last ``usage`` (vLLM and llama-server with
  ``stream_options.include_usage``; llama-server also sends one in the last
  event of a completion stream);
- llama-server's event stream without it: ``"timings"`` in its last event,
  ``prompt_n`` (prompt tokens it read) plus ``cache_n`` (prompt tokens it
  took from the slot's cache: tokens of this prompt all the same, as its
  own ``usage.prompt_tokens`` counts them) and ``predicted_n``;
- Ollama's ``/api/chat`` and ``/api/generate``, streamed (NDJSON, the
  line with ``"done": true``) or not: ``prompt_eval_count`` and
  ``eval_count`` (a prompt Ollama took whole from its cache may come
  without ``prompt_eval_count``: 0 then).

A stream that tells none (llama-cpp-python's, with or without
``include_usage``) is *estimated*: one completion token per event (``data:``
line, less the closing ``[DONE]``; one per line of an NDJSON stream), which
counts the role and finish events too, a token or two high per answer; and
one prompt token per four bytes of the request's body. An unstreamed answer
without counts (an error, a model list) has no usage at all.

The reader never parses an event: per chunk it keeps a reference to the
last eight reads and, in a stream, counts events with one ``bytes.count``.
At the end it searches those last reads for the counts' keys. A JSON string
cannot hold an unescaped ``"``, so ``"prompt_tokens"`` found there is a key,
never text the model wrote; the last of each key wins (vLLM's
``continuous_usage_stats`` repeats a growing ``usage`` in every event).
"""

from __future__ import annotations

import enum
import re

import attrs


class Body(enum.Enum):
    """How an answer's body is framed, for where its counts are."""

    WHOLE = "whole"  # one JSON document (or anything not a stream)
    EVENTS = "events"  # text/event-stream
    LINES = "lines"  # application/x-ndjson (Ollama's streams)


# What one event of a stream begins with, counted for an estimate.
_MARKERS = {Body.EVENTS: b"data:", Body.LINES: b"\n"}
# Bytes of a request's body per estimated prompt token (the usual rule of
# thumb for English text and BPE vocabularies).
BYTES_PER_TOKEN = 4

_USAGE_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_USAGE_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TIMINGS_PROMPT = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_TIMINGS_CACHE = re.compile(rb'"cache_n"\s*:\s*(\d+)')
_TIMINGS_PREDICTED = re.compile(rb'"predicted_n"\s*:\s*(\d+)')
_OLLAMA_PROMPT = re.compile(rb'"prompt_eval_count"\s*:\s*(\d+)')
_OLLAMA_EVAL = re.compile(rb'"eval_count"\s*:\s*(\d+)')
_DONE = b"[DONE]"


@attrs.frozen
class Usage:
    """An answer's tokens; ``estimated``: counted from its events, not told by the engine."""

    prompt_tokens: int
    completion_tokens: int
    estimated: bool = False


def body_kind(content_type: bytes | None) -> Body:
    """The framing of a body by its ``Content-Type`` (any case, any parameters)."""
    if content_type is None:
        return Body.WHOLE
    media_type = content_type.split(b";", 1)[0].strip().lower()
    if media_type == b"text/event-stream":
        return Body.EVENTS
    if media_type in (b"application/x-ndjson", b"application/jsonl", b"application/json-lines"):
        return Body.LINES
    return Body.WHOLE


def reported(tail: bytes) -> Usage | None:
    """The counts the engine told in the last bytes of its answer, if any.

    ``usage`` first, then llama-server's ``timings``, then Ollama's counts.
    A byte search for each key's end comes before its pattern: most
    answers without counts (model lists, errors) pay three of those only.
    """
    if b'_tokens"' in tail:
        completion = _last(_USAGE_COMPLETION, tail)
        if completion is not None:
            return Usage(_last(_USAGE_PROMPT, tail) or 0, completion)
    if b'predicted_n"' in tail:
        predicted = _last(_TIMINGS_PREDICTED, tail)
        if predicted is not None:
            prompt = (_last(_TIMINGS_PROMPT, tail) or 0) + (_last(_TIMINGS_CACHE, tail) or 0)
            return Usage(prompt, predicted)
    if b'eval_count"' in tail:
        evaluated = _last(_OLLAMA_EVAL, tail)
        if evaluated is not None:
            return Usage(_last(_OLLAMA_PROMPT, tail) or 0, evaluated)
    return None


def _last(pattern: re.Pattern[bytes], tail: bytes) -> int | None:
    found = pattern.findall(tail)
    return int(found[-1]) if found else None


# The reads of a body kept for the search at its end: a ring of references,
# so a read costs two assignments. Eight hold the last event of every
# engine recorded (some 600 bytes) even when it came a few dozen bytes a read.
KEPT_READS = 8  # a power of two: a read's place in the ring is a bitwise and
# The most bytes searched at the end: the counts are in an answer's last
# few hundred bytes, and a long unstreamed answer's reads are 64 KiB each.
TAIL_BYTES = 16384


class UsageReader:
    """Follows one answer's body, read by read, for its tokens at the end.

    Feed it every body chunk in order (the first one included); ask
    ``usage`` once the body ended.
    """

    __slots__ = ("_kept", "_marker", "_reads", "events")

    def __init__(self, body: Body) -> None:
        self._marker = _MARKERS.get(body)
        self._kept: list[bytes] = [b""] * KEPT_READS
        self._reads = 0
        self.events = 0  # the stream's events so far (its ``data:`` lines, or lines)

    def feed(self, chunk: bytes) -> None:
        """The next read of the body: kept among the last ones, its events counted."""
        reads = self._reads
        self._kept[reads & (KEPT_READS - 1)] = chunk
        self._reads = reads + 1
        if self._marker is not None:
            self.events += chunk.count(self._marker)

    def tail(self) -> bytes:
        """The last ``TAIL_BYTES`` of the reads kept, oldest first."""
        reads = self._reads
        if reads <= 1:  # an answer that came in one read (most unstreamed ones)
            tail = self._kept[0]
        else:
            cut = reads & (KEPT_READS - 1)
            tail = b"".join(self._kept[cut:] + self._kept[:cut])
        return tail[-TAIL_BYTES:] if len(tail) > TAIL_BYTES else tail

    def usage(self, request_bytes: int) -> Usage | None:
        """The answer's tokens: told by the engine, estimated for a stream, else None.

        Args:
            request_bytes: the size of the request's body (an estimate's prompt).
        """
        tail = self.tail()
        told = reported(tail)
        if told is not None or self._marker is None:
            return told
        events = self.events - (self._marker == b"data:" and _DONE in tail)
        prompt = -(-request_bytes // BYTES_PER_TOKEN)
        return Usage(prompt, max(events, 0), estimated=True)
