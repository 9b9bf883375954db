"""Table-driven tests of the duration and size parsers (trio_failover.units)."""

from __future__ import annotations

import pytest

from trio_failover.core.units import format_duration, format_size, parse_duration, parse_size

DURATIONS: list[tuple[str, float]] = [
    ("0", 0.0),
    ("+0", 0.0),
    ("-0", 0.0),
    (" 0 ", 0.0),
    ("300ms", 0.3),
    ("1.5s", 1.5),
    ("2m", 120.0),
    ("1h30m", 5400.0),
    ("1h", 3600.0),
    ("10s", 10.0),
    ("120s", 120.0),
    ("5m", 300.0),
    ("0s", 0.0),
    ("0.5s", 0.5),
    (".5s", 0.5),
    ("1.s", 1.0),
    ("1.1s", 1.1),
    ("+2s", 2.0),
    ("1m30s", 90.0),
    ("1h1m1s", 3661.0),
    ("2h45m30.5s", 9930.5),
    ("1s500ms", 1.5),  # Go allows units in any order and repeats; they add up
    ("100us", 0.0001),
    ("100\u00b5s", 0.0001),  # micro sign
    ("100\u03bcs", 0.0001),  # Greek mu
    ("250ns", 250e-9),
    ("1.000000001s", 1.000000001),
    ("  30s\n", 30.0),
]


@pytest.mark.parametrize(("text", "seconds"), DURATIONS)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


DURATION_REJECTS: list[tuple[str, str]] = [
    ("", "expected a duration"),
    ("   ", "expected a duration"),
    ("+", "expected a duration"),
    ("-", "expected a duration"),
    ("5", "needs a unit"),
    ("30", "needs a unit"),
    ("0.0", "needs a unit"),
    ("00", "needs a unit"),
    ("1.5", "needs a unit"),
    ("1h30", "needs a unit"),
    ("-1s", "must not be negative"),
    ("-5m", "must not be negative"),
    ("-0.5s", "must not be negative"),
    ("5x", "unknown unit 'x'"),
    ("5sec", "unknown unit 'sec'"),
    ("5S", "unknown unit 'S'"),
    ("1 s", "unknown unit ' s'"),
    ("1d", "unknown unit 'd'"),
    ("1e3s", "unknown unit 'e'"),
    ("s", "expected a duration"),
    (".s", "expected a duration"),
    ("1..5s", "needs a unit"),
    ("1s-2s", "unknown unit 's-'"),
    ("\u0665s", "expected a duration"),  # Arabic-Indic five: not an ASCII digit
    ("3000000h", "292 years"),
]


@pytest.mark.parametrize(("text", "message"), DURATION_REJECTS)
def test_parse_duration_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_duration(text)


FORMATTED_DURATIONS: list[tuple[float, str]] = [
    (0.0, "0"),
    (250e-9, "250ns"),
    (1.5e-6, "1.5us"),
    (0.0001, "100us"),
    (0.3, "300ms"),
    (0.0125, "12.5ms"),
    (1.0, "1s"),
    (1.5, "1.5s"),
    (4.0, "4s"),
    (30.0, "30s"),
    (75.0, "1m15s"),
    (90.5, "1m30.5s"),
    (120.0, "2m"),
    (300.0, "5m"),
    (3600.0, "1h"),
    (3661.0, "1h1m1s"),
    (5400.0, "1h30m"),
    (-2.0, "-2s"),
]


@pytest.mark.parametrize(("seconds", "text"), FORMATTED_DURATIONS)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("seconds", "text"), [c for c in FORMATTED_DURATIONS if c[0] >= 0])
def test_format_duration_round_trips(seconds: float, text: str) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


KiB = 1024
MiB = 1024 * KiB

SIZES: list[tuple[str, int]] = [
    ("0", 0),
    ("1", 1),
    ("4096", 4096),
    ("4096B", 4096),
    ("4096b", 4096),
    ("512KiB", 512 * KiB),
    ("32MiB", 32 * MiB),
    ("32mib", 32 * MiB),
    ("32 MiB", 32 * MiB),
    ("1GiB", 1024 * MiB),
    ("2TiB", 2 * 1024**4),
    ("1kB", 1000),
    ("1KB", 1000),
    ("1MB", 1_000_000),
    ("1GB", 1_000_000_000),
    ("1TB", 10**12),
    ("1.5MB", 1_500_000),
    ("1.5KiB", 1536),
    ("0.5MiB", 512 * KiB),
    (".5KiB", 512),
    (" 64KiB ", 64 * KiB),
]


@pytest.mark.parametrize(("text", "size"), SIZES)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


SIZE_REJECTS: list[tuple[str, str]] = [
    ("", "expected a size"),
    ("MiB", "expected a size"),
    ("-1", "must not be negative"),
    ("-32MiB", "must not be negative"),
    ("32M", "unknown size unit 'M'"),
    ("32k", "unknown size unit 'k'"),
    ("32 megabytes", "unknown size unit 'megabytes'"),
    ("1.5", "not a whole number of bytes"),
    ("0.3KiB", "not a whole number of bytes"),
    ("1e6", "expected a size"),
    ("32MiB!", "expected a size"),
    ("1,000", "expected a size"),
    ("9000000TiB", "smaller than 8EiB"),
]


@pytest.mark.parametrize(("text", "message"), SIZE_REJECTS)
def test_parse_size_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(text)


FORMATTED_SIZES: list[tuple[int, str]] = [
    (0, "0"),
    (1, "1"),
    (1500, "1500"),
    (1024, "1KiB"),
    (64 * KiB, "64KiB"),
    (32 * MiB, "32MiB"),
    (1024 * MiB, "1GiB"),
    (1000, "1kB"),
    (1_000_000, "1MB"),
    (1_500_000, "1500kB"),
]


@pytest.mark.parametrize(("size", "text"), FORMATTED_SIZES)
def test_format_size(size: int, text: str) -> None:
    assert format_size(size) == text
    assert parse_size(text) == size
