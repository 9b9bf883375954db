"""Kinds of values: how each type is parsed from text (flag, env) and from TOML, and shown.

Every parser raises ``ValueError`` whose message says what was expected;
the caller adds the option's name, the source and the value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from ...core.config import HOST_PORT_EXPECTED, redact_url, split_host_port
from ...core.engines import ENGINE_KINDS
from ...core.errors import ConfigError
from ...core.redis_url import masked_url, parse_state
from ...core.units import format_duration, format_size, parse_duration, parse_size

__all__ = [
    "ADMIN",
    "BOOL",
    "CAPACITIES",
    "CLIENTS",
    "CODES",
    "CONFIG_PATH",
    "DIGITS",
    "DURATION",
    "ENDPOINT",
    "ENGINES",
    "FILE",
    "HOST_PORT",
    "INT",
    "NODES",
    "SECRET",
    "SIZE",
    "STATE",
    "STATUSES",
    "TEXT",
    "TOKEN",
    "Kind",
    "capacity_toml",
    "choice_kind",
    "comma_list",
    "engine_toml",
    "existing_file",
    "expected_of",
    "show_path",
]


@attrs.frozen
class Kind:
    """How values of one type are parsed from text (flag, env) and from TOML, and shown.

    Both parsers raise ``ValueError`` whose message says what was expected.
    """

    name: str
    from_text: Callable[[str], Any]
    from_toml: Callable[[object], Any]
    show: Callable[[Any], str]


def _toml_str(parse: Callable[[str], Any], expected: str) -> Callable[[object], Any]:
    def from_toml(value: object) -> Any:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, {expected}")
        return parse(value)

    return from_toml


def _duration_toml(value: object) -> float:
    if isinstance(value, str):
        return parse_duration(value)
    # The integer 0 reads naturally as "off"; any other bare number is as
    # ambiguous in TOML as on the command line.
    if type(value) is int and value == 0:
        return 0.0
    raise ValueError('expected a duration string such as "10s"; only 0 may be a bare number')


def _int_text(text: str) -> int:
    # ASCII digits only, as for --capacity: int() would also read "1_000",
    # "+5" and "٣". A leading minus is read so the range check can say
    # "must not be negative".
    text = text.strip()
    if not DIGITS.fullmatch(text.removeprefix("-")):
        raise ValueError("expected a whole number")
    return int(text)


class QuotedNumber(ValueError):
    """A TOML string that holds a whole number where the number itself belongs.

    ``capacity = "2"``: the number is right, its quotes are the mistake, and
    "expected a whole number" would send the user looking for the wrong one.
    ``expected_of`` says it with the key, which only the caller knows.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__(f'"{text}" is a string; write it as a number: {text.strip()}')


def expected_of(exc: ValueError, key: str) -> str:
    """What a TOML value of ``key`` should have been, as the error says it."""
    if isinstance(exc, QuotedNumber):
        return f'{key} = "{exc.text}" is a string; write it as a number: {key} = {exc.text.strip()}'
    return str(exc)


def _refuse_quoted_number(value: object) -> None:
    if isinstance(value, str) and DIGITS.fullmatch(value.strip()):
        raise QuotedNumber(value)


def _int_toml(value: object) -> int:
    if type(value) is not int:
        _refuse_quoted_number(value)
        raise ValueError("expected a whole number")
    return value


def _size_toml(value: object) -> int:
    if type(value) is int:
        if value < 0:
            raise ValueError("a size must not be negative")
        return value
    if isinstance(value, str):
        return parse_size(value)
    raise ValueError('expected a size such as "32MiB" or a number of bytes')


def _host_port(text: str) -> str:
    split_host_port(text.strip())
    return text.strip()


def _admin_text(text: str) -> str | None:
    if text.strip().lower() == "off":
        return None
    try:
        return _host_port(text)
    except ConfigError as exc:
        expected = exc.expected + ", or off" if exc.expected == HOST_PORT_EXPECTED else exc.expected
        raise ValueError(expected) from None


def _admin_toml(value: object) -> str | None:
    if value is False:
        return None
    if not isinstance(value, str):
        raise ValueError('expected a string, "HOST:PORT" or "off"')
    return _admin_text(value)


def _choice(choices: tuple[str, ...], *, fold_case: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower() if fold_case else text.strip()
        if value not in choices:
            raise ValueError("expected one of " + ", ".join(choices))
        return value

    return parse


def _endpoint_text(text: str) -> str | None:
    # "off" turns traces off where a lower source (OTEL_EXPORTER_OTLP_ENDPOINT,
    # set for every program of a host or pod) would turn them on. The URL
    # itself is checked by Config's validator.
    value = text.strip()
    return None if value.lower() == "off" else value


def _status(item: object) -> int:
    # Only an error answer may be retried: a 2xx or 3xx is the node's real answer.
    if type(item) is not int:
        raise ValueError(f"{item!r} is not an HTTP status code")
    if not 400 <= item <= 599:
        raise ValueError(f"{item} is outside 400-599: only error statuses fail over")
    return item


def _statuses_text(text: str) -> frozenset[int]:
    statuses: set[int] = set()
    for item in comma_list(text):
        if not DIGITS.fullmatch(item):
            raise ValueError(f"{item!r} is not an HTTP status code")
        statuses.add(_status(int(item)))
    return frozenset(statuses)


def _statuses_toml(value: object) -> frozenset[int]:
    if not isinstance(value, list):
        raise ValueError("expected a list of status codes such as [429, 503]")
    return frozenset(_status(item) for item in value)


def _codes_text(text: str) -> frozenset[str]:
    return frozenset(comma_list(text))


def _codes_toml(value: object) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError('expected a list of error codes such as ["context_length_exceeded"]')
    return frozenset(str(item) for item in value)


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


# ASCII digits only: int() also reads "٣" and "+3".
DIGITS = re.compile(r"[0-9]+")


def existing_file(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a file path")
    if not Path(text).is_file():
        raise ValueError("no such file")
    return text


# -- per-node engine settings (docs/engines.md) --


def capacity_toml(value: object) -> int | None:
    """A TOML ``capacity``: a whole number, or ``"auto"`` (None)."""
    if value == "auto":
        return None
    _refuse_quoted_number(value)
    if type(value) is not int or value < 0:
        raise ValueError('expected a whole number of attempts, 0 (no limit) or more, or "auto"')
    return value


def engine_toml(value: object) -> str:
    """A TOML ``engine``: one of the engine kinds, as a string."""
    if not isinstance(value, str) or value not in ENGINE_KINDS:
        raise ValueError("expected one of " + ", ".join(f'"{kind}"' for kind in ENGINE_KINDS))
    return value


def show_path(value: str | None) -> str:
    return "none" if value is None else value


def _show_list(values: Iterable[int] | Iterable[str]) -> str:
    return ",".join(str(v) for v in sorted(values)) or "none"


SECRET = "***"


def _show_secret(value: str | None) -> str:
    return "none" if value is None else SECRET


DURATION = Kind(
    "duration", parse_duration, _duration_toml, lambda value: format_duration(float(value))
)
SIZE = Kind("size", parse_size, _size_toml, lambda value: format_size(int(value)))
INT = Kind("int", _int_text, _int_toml, str)
HOST_PORT = Kind("host:port", _host_port, _toml_str(_host_port, '"HOST:PORT"'), str)
ADMIN = Kind("host:port|off", _admin_text, _admin_toml, lambda v: "off" if v is None else str(v))
STATUSES = Kind("statuses", _statuses_text, _statuses_toml, _show_list)
CODES = Kind("codes", _codes_text, _codes_toml, _show_list)
FILE = Kind("path", existing_file, _toml_str(existing_file, "a file path"), show_path)
ENDPOINT = Kind(
    "url|off",
    _endpoint_text,
    _toml_str(_endpoint_text, 'a URL such as "http://127.0.0.1:4318", or "off"'),
    lambda value: "none" if value is None else redact_url(str(value)),
)


def _state_text(text: str) -> str:
    parse_state(text)
    return text.strip()


# --state: memory or a Redis URL, shown (and quoted in errors) without its password.
STATE = Kind(
    "memory|url", _state_text, _toml_str(_state_text, 'memory or "redis://HOST:PORT"'), masked_url
)
TEXT = Kind("text", str, _toml_str(str, "text"), show_path)
# The token's checks are Config's own validator (run on every given value).
TOKEN = Kind("token", str, str, _show_secret)
# --config, --upstream, --capacity, --engine and --api-key are read by resolve()
# itself; these kinds only show them.
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bool_text(text: str) -> bool:
    folded = text.strip().lower()
    if folded in _TRUE or folded in _FALSE:
        return folded in _TRUE
    raise ValueError("expected true or false")


def _bool_toml(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


BOOL = Kind("bool", _bool_text, _bool_toml, lambda value: "on" if value else "off")
"""A switch: a flag without a value (``--watch-config``), ``true``/``false`` elsewhere.

``check`` shows it as docs/configuration.md writes its default: ``on`` or ``off``.
"""
CONFIG_PATH = Kind("path", str, str, show_path)
NODES = Kind("nodes", str, str, str)
CAPACITIES = Kind("capacity", str, str, str)
ENGINES = Kind("engine", str, str, str)
CLIENTS = Kind("clients", str, str, str)


def choice_kind(choices: tuple[str, ...], *, fold_case: bool = False) -> Kind:
    parse = _choice(choices, fold_case=fold_case)
    expected = "one of " + ", ".join(choices)
    return Kind("|".join(choices), parse, _toml_str(parse, expected), str)
