"""The usage reader against answers recorded from the engines (tests/data/usage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_failover.core.usage import TAIL_BYTES, Body, Usage, UsageReader, body_kind, reported

DATA = Path(__file__).parent / "data" / "usage"
REQUEST = 100  # bytes of a request body: 25 estimated prompt tokens

# file, framing, the tokens read
RECORDED = [
    ("llama_server_chat.json", Body.WHOLE, Usage(11, 6)),
    ("llama_server_completion.json", Body.WHOLE, Usage(3, 5)),
    # timings only: prompt_n 5 + cache_n 6 = its usage's prompt_tokens 11
    ("llama_server_chat_stream.sse", Body.EVENTS, Usage(11, 6)),
    ("llama_server_chat_stream_usage.sse", Body.EVENTS, Usage(11, 6)),
    ("llama_server_completion_stream.sse", Body.EVENTS, Usage(3, 5)),
    ("llama_cpp_python_chat.json", Body.WHOLE, Usage(11, 6)),
    ("llama_cpp_python_completion.json", Body.WHOLE, Usage(3, 5)),
    # no counts in its streams: 9 data lines less [DONE] (6 tokens, a role, a finish)
    ("llama_cpp_python_chat_stream.sse", Body.EVENTS, Usage(25, 8, estimated=True)),
    ("llama_cpp_python_chat_stream_usage.sse", Body.EVENTS, Usage(25, 8, estimated=True)),
    ("llama_cpp_python_completion_stream.sse", Body.EVENTS, Usage(25, 6, estimated=True)),
    ("ollama_chat.json", Body.WHOLE, Usage(26, 298)),
    ("ollama_generate.json", Body.WHOLE, Usage(26, 290)),
    ("ollama_chat_stream.ndjson", Body.LINES, Usage(26, 282)),
    ("ollama_generate_stream_cached.ndjson", Body.LINES, Usage(0, 113)),
]


def read(body: bytes, framing: Body, size: int) -> Usage | None:
    reader = UsageReader(framing)
    for start in range(0, len(body), size):
        reader.feed(body[start : start + size])
    return reader.usage(REQUEST)


@pytest.mark.parametrize(("name", "framing", "expected"), RECORDED)
@pytest.mark.parametrize("size", [1 << 20, 200, 97])
def test_recorded_answers(name: str, framing: Body, expected: Usage, size: int) -> None:
    # Whole, and in reads that split events and keys: the counts of the
    # last event are found whichever reads carried them.
    body = (DATA / name).read_bytes()
    assert read(body, framing, size) == expected


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        (b"", None),
        (b'{"models": []}', None),
        # an answer's text may say "prompt_tokens", but only escaped
        (b'{"content": "\\"prompt_tokens\\": 9"}', None),
        (b'"usage":{"completion_tokens":4}', Usage(0, 4)),
        (b'"usage" : { "prompt_tokens" : 7 , "completion_tokens" : 2 }', Usage(7, 2)),
        # vLLM's continuous usage: the last one wins
        (
            b'"usage":{"prompt_tokens":7,"completion_tokens":1} "usage":{"prompt_tokens":7,'
            b'"completion_tokens":2}',
            Usage(7, 2),
        ),
        # usage before timings, whichever comes first in the bytes
        (
            b'"timings":{"prompt_n":1,"predicted_n":3},"usage":{"prompt_tokens":5,'
            b'"completion_tokens":3}',
            Usage(5, 3),
        ),
        (b'"timings":{"prompt_n":4,"predicted_n":3}', Usage(4, 3)),
        (b'"prompt_eval_count":2,"eval_count":9', Usage(2, 9)),
        (b'"prompt_eval_count":2', None),
    ],
)
def test_reported(tail: bytes, expected: Usage | None) -> None:
    assert reported(tail) == expected


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        (None, Body.WHOLE),
        (b"application/json", Body.WHOLE),
        (b"text/event-stream; charset=utf-8", Body.EVENTS),
        (b"Text/Event-Stream", Body.EVENTS),
        (b"application/x-ndjson", Body.LINES),
        (b"text/plain", Body.WHOLE),
    ],
)
def test_body_kind(content_type: bytes | None, expected: Body) -> None:
    assert body_kind(content_type) == expected


def test_whole_answer_without_counts_has_no_usage() -> None:
    assert read(b'{"error": "no such model"}', Body.WHOLE, 64) is None


def test_stream_without_events_is_an_estimate_of_none() -> None:
    # A prompt of 9 bytes rounds up to 3 tokens of 4 bytes (REQUEST aside).
    reader = UsageReader(Body.EVENTS)
    reader.feed(b": ping\n\n")
    assert reader.usage(9) == Usage(3, 0, estimated=True)


def test_ndjson_without_counts_counts_lines() -> None:
    reader = UsageReader(Body.LINES)
    reader.feed(b'{"response":"a"}\n{"response":"b"}\n')
    reader.feed(b'{"response":"c"}\n')
    assert reader.usage(0) == Usage(0, 3, estimated=True)


def test_a_long_answer_is_searched_only_at_its_end() -> None:
    # An answer of 64 KiB reads: only the last TAIL_BYTES are searched, where the counts are.
    reader = UsageReader(Body.WHOLE)
    reader.feed(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "x": "' + b"a" * 65536)
    reader.feed(b'", "usage": {"prompt_tokens": 2, "completion_tokens": 3}}')
    assert reader.usage(0) == Usage(2, 3)
    assert len(reader.tail()) == TAIL_BYTES
