"""Pure: durations and sizes as people write them, and back.

Durations follow Go's ``time.ParseDuration`` (``300ms``, ``1.5s``, ``1h30m``)
because that is what operators of LLM servers already type into Ollama's and
vLLM's neighbours; a bare number is refused (except ``0``) so that ``30``
never silently means thirty seconds to one reader and thirty minutes to
another. Negative durations are refused here rather than in ``Config`` so the
message can say so in the user's own terms.

Sizes accept binary (``KiB``, ``MiB``...) and decimal (``kB``, ``MB``...)
units or plain bytes. Both parsers raise ``ValueError`` whose message says
what was expected; ``cli/settings/`` adds the option name and the source.

Arithmetic is done in exact fractions so that ``1.1s`` is the nearest float
to 1.1, not the sum of rounding errors.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["format_duration", "format_size", "parse_duration", "parse_size"]

_NS_PER_S = 10**9
# Go's limit: a duration is an int64 count of nanoseconds (about 292 years).
_MAX_NS = 2**63 - 1

_DURATION_UNITS: dict[str, int] = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # MICRO SIGN, as Go accepts
    "\u03bcs": 1_000,  # GREEK SMALL LETTER MU, as Go accepts
    "ms": 1_000_000,
    "s": _NS_PER_S,
    "m": 60 * _NS_PER_S,
    "h": 3600 * _NS_PER_S,
}

# One "<number><unit>" step of a duration. ASCII digits only: \d would also
# match other scripts' digits, which Go does not accept either.
_DURATION_STEP = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([^0-9.]*)")

_EXPECTED_DURATION = "a duration such as 300ms, 1.5s, 2m or 1h30m"
_UNIT_LIST = "h, m, s, ms, us or ns"

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)\s*([A-Za-z]*)")
_EXPECTED_SIZE = "a size such as 32MiB, 512KiB, 1GB or a number of bytes"
_MAX_SIZE = 2**63 - 1

# For display, the largest unit that divides the value exactly wins.
_SIZE_DISPLAY: tuple[tuple[str, int], ...] = (
    ("TiB", 1024**4),
    ("GiB", 1024**3),
    ("MiB", 1024**2),
    ("KiB", 1024),
    ("TB", 1000**4),
    ("GB", 1000**3),
    ("MB", 1000**2),
    ("kB", 1000),
)


def parse_duration(text: str) -> float:
    """Parse a Go-style duration into seconds.

    Args:
        text: ``300ms``, ``1.5s``, ``2m``, ``1h30m``, ``0``... Units are
            ``h``, ``m``, ``s``, ``ms``, ``us`` (or ``µs``) and ``ns``;
            surrounding whitespace is ignored.

    Returns:
        The duration in seconds, never negative.

    Raises:
        ValueError: not a duration, a number without a unit (other than
            ``0``), an unknown unit, a negative or an absurdly large value.
    """
    body = text.strip()
    negative = body.startswith("-")
    if body[:1] in ("-", "+"):
        body = body[1:]
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f"expected {_EXPECTED_DURATION}")
    total = Fraction(0)
    pos = 0
    while pos < len(body):
        step = _DURATION_STEP.match(body, pos)
        if step is None:
            raise ValueError(f"expected {_EXPECTED_DURATION}")
        number, unit = step.groups()
        if not unit:
            raise ValueError(
                f"a duration needs a unit ({_UNIT_LIST}), as in 10s; only 0 may go without"
            )
        if unit not in _DURATION_UNITS:
            raise ValueError(f"unknown unit {unit!r} in a duration; use {_UNIT_LIST}")
        total += Fraction(number) * _DURATION_UNITS[unit]
        pos = step.end()
    if negative and total:
        raise ValueError("a duration must not be negative")
    if total > _MAX_NS:
        raise ValueError("a duration must be shorter than 292 years")
    return float(total / _NS_PER_S)


def format_duration(seconds: float) -> str:
    """Write ``seconds`` the way ``parse_duration`` reads it back.

    ``0`` -> ``"0"``, ``0.3`` -> ``"300ms"``, ``90.5`` -> ``"1m30.5s"``,
    ``5400`` -> ``"1h30m"``. Precision is one nanosecond.
    """
    ns = round(Fraction(seconds) * _NS_PER_S)
    if ns == 0:
        return "0"
    if ns < 0:
        return "-" + format_duration(-seconds)
    if ns < 1_000:
        return f"{ns}ns"
    if ns < 1_000_000:
        return _decimal(ns, 1_000) + "us"
    if ns < _NS_PER_S:
        return _decimal(ns, 1_000_000) + "ms"
    hours, rest = divmod(ns, 3600 * _NS_PER_S)
    minutes, rest = divmod(rest, 60 * _NS_PER_S)
    parts = []
    if hours:
        parts.append(f"{hours}h")
    if minutes:
        parts.append(f"{minutes}m")
    if rest:
        parts.append(_decimal(rest, _NS_PER_S) + "s")
    return "".join(parts)


def _decimal(count: int, unit: int) -> str:
    """``count / unit`` as a decimal without trailing zeros (unit is a power of ten)."""
    whole, frac = divmod(count, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def parse_size(text: str) -> int:
    """Parse a size into bytes.

    Args:
        text: ``32MiB``, ``512KiB``, ``1GB``, ``1.5MB``, ``4096`` or
            ``4096B``. Units are case-insensitive; ``k``/``M``/``G`` alone
            are refused because they are ambiguous between 1000 and 1024.

    Returns:
        The number of bytes.

    Raises:
        ValueError: not a size, an unknown unit, negative, or a fraction
            that is not a whole number of bytes.
    """
    body = text.strip()
    if body.startswith("-"):
        raise ValueError("a size must not be negative")
    match = _SIZE_RE.fullmatch(body)
    if match is None:
        raise ValueError(f"expected {_EXPECTED_SIZE}")
    number, unit = match.groups()
    multiplier = _SIZE_UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(f"unknown size unit {unit!r}; use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB")
    size = Fraction(number) * multiplier
    if size.denominator != 1:
        raise ValueError(f"{text.strip()} is not a whole number of bytes")
    if size > _MAX_SIZE:
        raise ValueError("a size must be smaller than 8EiB")
    return int(size)


def format_size(size: int) -> str:
    """Write ``size`` bytes with the largest unit that divides it exactly.

    ``33554432`` -> ``"32MiB"``, ``1000000`` -> ``"1MB"``, ``1500`` -> ``"1500"``.
    """
    for name, unit in _SIZE_DISPLAY:
        if size >= unit and size % unit == 0:
            return f"{size // unit}{name}"
    return str(size)
