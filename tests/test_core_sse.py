"""Table tests of the SSE progress scanner (trio_failover.core.sse)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_failover.core.sse import SseScanner, is_event_stream


def feed(chunks: Sequence[bytes]) -> list[int | None]:
    scanner = SseScanner()
    return [scanner.first_event_line(chunk) for chunk in chunks]


# chunks as read -> first_event_line of each
CASES = [
    pytest.param([b"data: x\n\n"], [0], id="event-first"),
    pytest.param([b": ping\n\n"], [None], id="comment-only"),
    pytest.param([b": ping\n\ndata: x\n\n"], [8], id="comment-then-event"),
    pytest.param([b"\n\n\r\n\r\r"], [None], id="blank-lines-of-every-ending"),
    pytest.param([b":a\r\ndata"], [4], id="crlf"),
    pytest.param([b":a\rdata"], [3], id="bare-cr"),
    pytest.param([b":a\ndata"], [3], id="lf"),
    pytest.param([b":a\r", b"\ndata"], [None, 1], id="crlf-split-between-cr-and-lf"),
    pytest.param([b":a\r", b"data"], [None, 0], id="cr-at-end-then-event"),
    pytest.param([b":a\r", b"\n", b":b\n"], [None, None, None], id="crlf-split-comments"),
    pytest.param([b":", b" ping data: no\n"], [None, None], id="comment-split-keeps-its-kind"),
    pytest.param([b"da", b"ta: x\n"], [0, None], id="event-split-counts-once"),
    pytest.param([b"data: a", b"bc\n\n", b": ping\n"], [0, None, None], id="rest-of-event"),
    pytest.param([b"data: a\n", b"\n", b": p\n\n"], [0, None, None], id="terminator-alone"),
    pytest.param([b"data: a\n\n", b"data: b\n\n"], [0, 0], id="two-events"),
    pytest.param([b"", b": p\n", b""], [None, None, None], id="empty-reads"),
    pytest.param([b"x:y\n"], [0], id="colon-later-in-line"),
    pytest.param([b"\n\nid: 1\n"], [2], id="blank-then-field"),
    pytest.param([b" :x\n"], [0], id="leading-space-is-not-a-comment"),
]


@pytest.mark.parametrize(("chunks", "expected"), CASES)
def test_first_event_line(chunks: list[bytes], expected: list[int | None]) -> None:
    assert feed(chunks) == expected


@pytest.mark.parametrize(("chunks", "expected"), CASES)
def test_progress_is_first_event_line_found(
    chunks: list[bytes], expected: list[int | None]
) -> None:
    scanner = SseScanner()
    assert [scanner.progress(chunk) for chunk in chunks] == [e is not None for e in expected]


def test_pings_after_commit_are_no_progress() -> None:
    # An engine stuck after its first token while its web server pings.
    scanner = SseScanner()
    assert scanner.progress(b'data: {"token": 1}\n\n')
    assert [scanner.progress(b": ping\n\n") for _ in range(5)] == [False] * 5
    assert scanner.progress(b"data: [DONE]\n\n")


def test_repr_shows_state_only() -> None:
    scanner = SseScanner()
    scanner.first_event_line(b"data")
    assert repr(scanner) == "SseScanner(at_line_start=False)"


# -- whole or split: the same answers -------------------------------------------------


def line_starts_of_progress(stream: bytes) -> list[int]:
    """Reference: parse the whole stream into lines (CRLF paired, as SSE does)."""
    starts: list[int] = []
    index = 0
    while index < len(stream):
        end = index
        while end < len(stream) and stream[end] not in b"\r\n":
            end += 1
        if end > index and stream[index] != ord(":"):
            starts.append(index)
        if end + 1 < len(stream) and stream[end : end + 2] == b"\r\n":
            end += 1
        index = end + 1
    return starts


def expected_for(stream: bytes, cuts: Sequence[int]) -> list[int | None]:
    starts = line_starts_of_progress(stream)
    bounds = [0, *cuts, len(stream)]
    answers: list[int | None] = []
    for low, high in itertools.pairwise(bounds):
        inside = [start - low for start in starts if low <= start < high]
        answers.append(inside[0] if inside else None)
    return answers


def split(stream: bytes, cuts: Sequence[int]) -> list[bytes]:
    bounds = [0, *cuts, len(stream)]
    return [stream[low:high] for low, high in itertools.pairwise(bounds)]


# Streams made of the bytes that matter: line ends, colons, and ordinary bytes.
streams = st.lists(
    st.sampled_from([b"\r", b"\n", b"\r\n", b":", b": ping", b"data: x", b"a", b" "]),
    max_size=30,
).map(b"".join)


@given(streams)
def test_every_single_split_agrees_with_the_whole(stream: bytes) -> None:
    whole = feed([stream])
    assert whole == expected_for(stream, [])
    first = whole[0]
    for cut in range(len(stream) + 1):
        answers = feed(split(stream, [cut]))
        assert answers == expected_for(stream, [cut])
        # Before commit the shell takes the first hit: the same byte either way.
        hits = [low + a for low, a in zip([0, cut], answers, strict=True) if a is not None]
        assert (hits[0] if hits else None) == first


@given(streams, st.data())
def test_any_splitting_agrees_with_the_whole(stream: bytes, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    assert feed(split(stream, cuts)) == expected_for(stream, cuts)


def test_reference_parser_pairs_crlf() -> None:
    # The oracle itself: "\r\n" is one line end, "\n\r" two.
    assert line_starts_of_progress(b"a\r\nb\n\rc") == [0, 3, 6]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"text/event-stream", True),
        (b"Text/Event-Stream; charset=utf-8", True),
        (b" text/event-stream ", True),
        (b"application/json", False),
        (b"text/event-streams", False),
        (b"", False),
        (None, False),
    ],
)
def test_is_event_stream(value: bytes | None, expected: bool) -> None:
    assert is_event_stream(value) is expected
