"""Settings: the table of options and their resolution from four sources.

Every option is one row of ``OPTIONS``: its flag, its environment variable,
its key in the TOML file, how text and TOML values are parsed and how the
value is shown. ``resolve`` reads the flags, the environment and the config
file, applies the precedence flag > environment > file > default, builds the
``Config`` and returns, next to it, the ``Source`` of every value.

Three rules shape the errors:

- Every value that is given is checked, even one that a higher-precedence
  source overrides: a broken line in the config file should not wait for the
  day somebody drops the flag that hid it.
- Every mistake is reported, not only the first: ``resolve`` raises one
  ``ConfigError`` for a single mistake and a ``ConfigErrors`` holding each
  of them for several, so that a file with five typos takes one round, not
  five.
- A ``ConfigError`` always names the option as the user wrote it (``--flag``
  name, or TOML key), the source (``--first-body-timeout``,
  ``TRIO_FAILOVER_FIRST_BODY_TIMEOUT`` or ``config.toml:12``), the value as
  given (never a header value, a client key or the admin token: those are
  secrets, and an error about one names the client or node instead) and
  what was expected. ``Config``'s own validators only know attribute names;
  their errors are relabelled here.

Two options do not follow flag > environment > file: ``--capacity``, whose
per-node values beat the bare default of a higher-precedence source (see
``_resolve_capacity``), and the lists (``--upstream``, ``--api-key``), which
are taken whole from the first source that has one.

This module reads the config file but imports neither trio nor time.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import re
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from ..core.config import (
    AFFINITY_CHOICES,
    BALANCE_CHOICES,
    CLIENT_CLOSE_CHOICES,
    HOST_PORT_EXPECTED,
    LOG_FORMAT_CHOICES,
    LOG_LEVEL_CHOICES,
    ClientKey,
    Config,
    Upstream,
    redact_url,
    split_host_port,
)
from ..core.errors import ConfigError, ConfigErrors
from ..core.units import format_duration, format_size, parse_duration, parse_size

__all__ = [
    "ENV_PREFIX",
    "OPTIONS",
    "ConfigFile",
    "Kind",
    "Option",
    "Source",
    "describe",
    "expand_env",
    "option",
    "resolve",
]

ENV_PREFIX = "TRIO_FAILOVER_"

SourceKind = Literal["flag", "env", "file", "default"]


@attrs.frozen
class Source:
    """Where one setting came from.

    ``where`` is the flag (``--listen``), the environment variable
    (``TRIO_FAILOVER_LISTEN``) or ``FILE:LINE``; empty for a default.
    ``raw`` is the value as given there, kept to quote it in errors.
    """

    kind: SourceKind
    where: str = ""
    raw: object = None

    def __str__(self) -> str:
        return self.kind if self.kind == "default" else f"{self.kind} {self.where}"


DEFAULT = Source("default")


# --- Kinds: how one type of value is read and shown ---------------------------------------------


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
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("expected a whole number") from None


def _int_toml(value: object) -> int:
    if type(value) is not int:
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


def _status(item: object) -> int:
    # Only an error answer may be retried: a 2xx or 3xx is the node's real answer.
    if type(item) is not int:
        raise ValueError(f"{item!r} is not an HTTP status code")
    if not 400 <= item <= 599:
        raise ValueError(f"{item} is outside 400-599: only error statuses fail over")
    return item


def _statuses_text(text: str) -> frozenset[int]:
    statuses: set[int] = set()
    for item in _comma_list(text):
        if not _DIGITS.fullmatch(item):
            raise ValueError(f"{item!r} is not an HTTP status code")
        statuses.add(_status(int(item)))
    return frozenset(statuses)


def _statuses_toml(value: object) -> frozenset[int]:
    if not isinstance(value, list):
        raise ValueError("expected a list of status codes such as [429, 503]")
    return frozenset(_status(item) for item in value)


def _codes_text(text: str) -> frozenset[str]:
    return frozenset(_comma_list(text))


def _codes_toml(value: object) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError('expected a list of error codes such as ["context_length_exceeded"]')
    return frozenset(str(item) for item in value)


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


# ASCII digits only: int() also reads "٣" and "+3".
_DIGITS = re.compile(r"[0-9]+")


def _existing_file(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a file path")
    if not Path(text).is_file():
        raise ValueError("no such file")
    return text


def _show_path(value: str | None) -> str:
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
FILE = Kind("path", _existing_file, _toml_str(_existing_file, "a file path"), _show_path)
# The token's checks are Config's own validator (run on every given value).
TOKEN = Kind("token", str, str, _show_secret)
# --config, --upstream, --capacity and --api-key are read by resolve()
# itself; these kinds only show them.
CONFIG_PATH = Kind("path", str, str, _show_path)
NODES = Kind("nodes", str, str, str)
CAPACITIES = Kind("capacity", str, str, str)
CLIENTS = Kind("clients", str, str, str)


def _choice_kind(choices: tuple[str, ...], *, fold_case: bool = False) -> Kind:
    parse = _choice(choices, fold_case=fold_case)
    expected = "one of " + ", ".join(choices)
    return Kind("|".join(choices), parse, _toml_str(parse, expected), str)


# --- The option table ----------------------------------------------------------------------------


@attrs.frozen
class Option:
    """One setting: its flag, environment variable, TOML key, parser and help.

    ``name`` is the key in the ``flags`` mapping given to ``resolve`` (and the
    CLI's parameter name); ``field`` the ``Config`` attribute it sets (None
    for the options that ``resolve`` reads itself). A ``repeat`` flag may be
    given several times (its ``flags`` value is a list); a ``secret`` one's
    value never shows, in errors or sources.
    """

    name: str
    flag: str
    toml: tuple[str, ...] | None
    kind: Kind
    metavar: str
    help: str
    field: str | None = None
    env: str = ""
    repeat: bool = False
    secret: bool = False
    default_note: str = ""

    @property
    def label(self) -> str:
        """The option's name as written on the command line, without dashes."""
        return self.flag.removeprefix("--")

    @property
    def toml_key(self) -> str:
        """The dotted TOML key (``timeouts.connect``), or "" if the file has none."""
        return ".".join(self.toml) if self.toml else ""

    @property
    def default(self) -> Any:
        """The value used when no source gives one (``Config``'s default)."""
        if self.field is None:
            return None
        return attrs.fields_dict(Config)[self.field].default

    @property
    def default_text(self) -> str:
        """The default as a user would write it."""
        if self.default_note:
            return self.default_note
        return "none" if self.field is None else self.kind.show(self.default)


def _option(
    name: str,
    toml_key: str | None,
    kind: Kind,
    metavar: str,
    help: str,
    *,
    field: str | None = "",
    env: str = "",
    repeat: bool = False,
    secret: bool = False,
    default_note: str = "",
) -> Option:
    return Option(
        name=name,
        flag="--" + name.replace("_", "-"),
        toml=tuple(toml_key.split(".")) if toml_key else None,
        kind=kind,
        metavar=metavar,
        help=help,
        field=name if field == "" else field,
        env=env or ENV_PREFIX + name.upper(),
        repeat=repeat,
        secret=secret,
        default_note=default_note,
    )


_CLIENT_CLOSE = _choice_kind(CLIENT_CLOSE_CHOICES)
_AFFINITY = _choice_kind(AFFINITY_CHOICES)
_BALANCE = _choice_kind(BALANCE_CHOICES)
_LOG_FORMAT = _choice_kind(LOG_FORMAT_CHOICES)
_LOG_LEVEL = _choice_kind(LOG_LEVEL_CHOICES, fold_case=True)

# fmt: off
OPTIONS: tuple[Option, ...] = (
    # name, TOML key, kind, metavar, help
    _option("config", None, CONFIG_PATH, "PATH", "TOML config file.", field=None),
    _option("listen", "listen", HOST_PORT, "HOST:PORT", "Client listener; port 0 = any free port."),
    _option("admin_listen", "admin_listen", ADMIN, "HOST:PORT|off", "Admin listener, or off."),
    _option("upstream", "upstream", NODES, "[NAME=]URL",
            "A node, in ranking order; repeat for more. NAME defaults to host:port.",
            field=None, env=ENV_PREFIX + "UPSTREAMS", repeat=True),
    _option("connect_timeout", "timeouts.connect", DURATION, "DUR",
            "TCP (+TLS) connect limit per attempt."),
    _option("response_header_timeout", "timeouts.response_header", DURATION, "DUR",
            "From request written to whole response head read."),
    _option("first_body_timeout", "timeouts.first_body", DURATION, "DUR",
            "From response head to first body byte; 0 = off."),
    _option("stream_idle_timeout", "timeouts.stream_idle", DURATION, "DUR",
            "After commit, longest silence between body bytes; 0 = off."),
    _option("dead_peer_timeout", "timeouts.dead_peer", DURATION, "DUR",
            "TCP keepalive + TCP_USER_TIMEOUT on upstream sockets; 0 = off."),
    _option("client_close", "client_close", _CLIENT_CLOSE, "abort|rst-only|ignore",
            "What a client FIN/RST does to in-flight work."),
    _option("max_attempts", "max_attempts", INT, "N",
            "Attempts per workload; 0 = one per candidate."),
    _option("affinity", "affinity", _AFFINITY, "off|prefix",
            "prefix: requests sharing a prompt prefix prefer the same node."),
    _option("capacity", "capacity", CAPACITIES, "N|NAME=N",
            "Attempts in flight per node, 0 = no limit; NAME=N for one node, N for the rest. "
            "Repeat, or comma-separate.",
            field=None, repeat=True, default_note="0"),
    _option("balance", "balance", _BALANCE, "priority|least-loaded",
            "Order of the ready nodes with a free slot: ranking, or least loaded first."),
    _option("queue_timeout", "timeouts.queue", DURATION, "DUR",
            "Longest wait in the queue for a slot, then 503; 0 = no limit."),
    _option("max_queue", "max_queue", INT, "N",
            "Workloads waiting at once; one more gets 503 at once; 0 = no limit."),
    _option("discovery_interval", "discovery_interval", DURATION, "DUR",
            "How often each node's models and health are checked; 0 = off."),
    _option("unstreamed_timeout", "timeouts.unstreamed", DURATION, "DUR",
            "Replaces the response-header timeout for requests that are not streamed."),
    _option("retry_status", "retry_status", STATUSES, "LIST",
            "Upstream statuses that fail over before commit (comma-separated)."),
    _option("retry_error_codes", "retry_error_codes", CODES, "LIST",
            "4xx JSON error.code values that fail over before commit; empty = none."),
    _option("max_request_body", "max_request_body", SIZE, "SIZE",
            "Larger request bodies get 413."),
    _option("max_request_head", "max_request_head", SIZE, "SIZE",
            "Larger request heads get 431."),
    _option("client_header_timeout", "timeouts.client_header", DURATION, "DUR",
            "A client's request head must arrive within this (408)."),
    _option("keepalive_timeout", "timeouts.keepalive", DURATION, "DUR",
            "Idle client keep-alive connections are closed after this."),
    _option("max_connections", "max_connections", INT, "N",
            "Concurrent client connections; more wait in the backlog."),
    _option("shutdown_timeout", "timeouts.shutdown", DURATION, "DUR",
            "On SIGTERM/SIGINT, in-flight workloads get this long to finish."),
    _option("pool_idle_timeout", "timeouts.pool_idle", DURATION, "DUR",
            "Idle upstream connections are closed after this."),
    _option("api_key", "client", CLIENTS, "[NAME=]KEY",
            "A client key; repeat for more. Any key turns key checks on. NAME defaults to key-N.",
            field=None, env=ENV_PREFIX + "API_KEYS", repeat=True, secret=True),
    _option("admin_token", None, TOKEN, "TOKEN",
            "Required on every admin route but /healthz.", secret=True),
    _option("tls_cert", "tls_cert", FILE, "PATH", "Certificate (PEM) for TLS on the listener."),
    _option("tls_key", "tls_key", FILE, "PATH", "Private key (PEM) of --tls-cert."),
    _option("log_format", "log_format", _LOG_FORMAT, "text|json", "Log line format."),
    _option("log_level", "log_level", _LOG_LEVEL, "LEVEL",
            "One of " + ", ".join(LOG_LEVEL_CHOICES) + "."),
)
# fmt: on

_BY_NAME: dict[str, Option] = {opt.name: opt for opt in OPTIONS}
_BY_FIELD: dict[str, Option] = {opt.field: opt for opt in OPTIONS if opt.field}


def option(name: str) -> Option:
    """The row of ``OPTIONS`` called ``name`` (``"first_body_timeout"``).

    Raises:
        KeyError: there is no such option.
    """
    return _BY_NAME[name]


# --- The config file ------------------------------------------------------------------------------

_TIMEOUTS = "timeouts"
_UPSTREAM = "upstream"
_CLIENT = "client"
_CAPACITY = "capacity"
_TOP_KEYS: tuple[str, ...] = (
    *(opt.toml[0] for opt in OPTIONS if opt.toml and len(opt.toml) == 1),
    _TIMEOUTS,
)  # includes "upstream", "client" and "capacity"
_TIMEOUT_KEYS: tuple[str, ...] = tuple(
    opt.toml[1] for opt in OPTIONS if opt.toml and opt.toml[0] == _TIMEOUTS
)
_NODE_KEYS: tuple[str, ...] = (
    "name",
    "url",
    "models",
    "headers",
    "ca_file",
    "insecure_skip_verify",
    _CAPACITY,
)
_CLIENT_KEYS: tuple[str, ...] = ("name", "key")

# Enough of TOML's key grammar to find which line wrote which key (tomllib
# keeps no positions). Bare keys, quoted keys and dotted keys.
_BARE = r"[A-Za-z0-9_-]+"
_BASIC = r'"(?:[^"\\]|\\.)*"'
_LITERAL = r"'[^']*'"
_PART = rf"(?:{_BARE}|{_BASIC}|{_LITERAL})"
_DOTTED = rf"{_PART}(?:[ \t]*\.[ \t]*{_PART})*"
_PART_RE = re.compile(_PART)
_TABLE_LINE = re.compile(rf"[ \t]*(\[\[?)[ \t]*({_DOTTED})[ \t]*\]")
_KEY_LINE = re.compile(rf"[ \t]*({_DOTTED})[ \t]*=")
_DECODE_LINE = re.compile(r"\(at line (\d+), column \d+\)")

KeyPath = tuple[str | int, ...]
_MISSING = object()


def _split_key(dotted: str) -> tuple[str, ...]:
    parts: list[str] = []
    for token in _PART_RE.findall(dotted):
        if token.startswith('"'):
            try:
                parts.append(str(json.loads(token)))
            except ValueError:
                parts.append(token[1:-1])
        elif token.startswith("'"):
            parts.append(token[1:-1])
        else:
            parts.append(token)
    return tuple(parts)


def _key_lines(text: str) -> dict[KeyPath, int]:
    """Map each key path (``("upstream", 1, "url")``) to the line that wrote it."""
    lines: dict[KeyPath, int] = {}
    table: KeyPath = ()
    arrays: dict[tuple[str, ...], int] = {}  # [[name]] -> how many seen so far
    multiline: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if multiline is not None:
            if line.count(multiline) % 2 == 1:
                multiline = None
            continue
        header = _TABLE_LINE.match(line)
        if header is not None:
            names = _split_key(header.group(2))
            if header.group(1) == "[[":
                arrays[names] = arrays.get(names, 0) + 1
            path: list[str | int] = []
            for depth in range(len(names)):
                path.append(names[depth])
                count = arrays.get(names[: depth + 1])
                if count:
                    path.append(count - 1)
            table = tuple(path)
            lines.setdefault(table, number)
            continue
        key = _KEY_LINE.match(line)
        if key is not None:
            lines.setdefault(table + _split_key(key.group(1)), number)
            rest = line[key.end() :]
            for quotes in ('"""', "'''"):
                if rest.count(quotes) % 2 == 1:
                    multiline = quotes
                    break
    return lines


@attrs.frozen
class ConfigFile:
    """A parsed TOML config file that knows on which line each key was written.

    ``mistakes`` are the errors of its layout (unknown keys, a ``[timeouts]``
    that is not a table...), kept for ``resolve`` to report together with
    the errors of the values.
    """

    name: str
    data: Mapping[str, Any]
    lines: Mapping[KeyPath, int] = attrs.field(factory=dict, repr=False)
    mistakes: tuple[ConfigError, ...] = attrs.field(default=(), repr=False)

    @classmethod
    def parse(cls, text: str, name: str = "config.toml") -> ConfigFile:
        """Parse TOML text and find its unknown keys (into ``mistakes``).

        Raises:
            ConfigError: a syntax error, with ``name:line`` as the source.
        """
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            message = str(exc)
            match = _DECODE_LINE.search(message)
            line = int(match.group(1)) if match else max(1, len(text.splitlines()))
            raise ConfigError(
                "config", name, f"not valid TOML: {message}", f"{name}:{line}"
            ) from None
        file = cls(name, data, _key_lines(text))
        return attrs.evolve(file, mistakes=tuple(file._key_mistakes()))

    @classmethod
    def read(cls, path: str, source: Source = DEFAULT) -> ConfigFile:
        """Read and parse the file at ``path``; ``source`` says who named it.

        Raises:
            ConfigError: the file is unreadable, not UTF-8 or not TOML.
        """
        where = source.where or "--config"
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError("config", path, f"cannot read it: {exc.strerror}", where) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("config", path, "the file is not UTF-8 text", where) from None
        return cls.parse(text, path)

    def where(self, *path: str | int) -> str:
        """``name:line`` of the key at ``path`` (or of its nearest written parent)."""
        for depth in range(len(path), 0, -1):
            line = self.lines.get(path[:depth])
            if line is not None:
                return f"{self.name}:{line}"
        return self.name

    def _lookup(self, path: Sequence[str]) -> object:
        """The value at ``path``, or the ``_MISSING`` sentinel."""
        node: object = self.data
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                return _MISSING
            node = node[key]
        return node

    def tables(self, key: str) -> list[Mapping[str, Any]] | None:
        """The ``[[key]]`` tables (none: ``[]``); None when ``key`` is not an array of tables."""
        tables = self.data.get(key, [])
        if not isinstance(tables, list) or not all(isinstance(t, Mapping) for t in tables):
            return None
        return tables

    def _key_mistakes(self) -> list[ConfigError]:
        found = self._unknown_keys(self.data, (), _TOP_KEYS, "at the top level")
        timeouts = self.data.get(_TIMEOUTS, {})
        if isinstance(timeouts, Mapping):
            found += self._unknown_keys(timeouts, (_TIMEOUTS,), _TIMEOUT_KEYS, "in [timeouts]")
        else:
            found.append(self._error((_TIMEOUTS,), timeouts, "expected a [timeouts] table"))
        for array, known, what in (
            (_UPSTREAM, _NODE_KEYS, "nodes"),
            (_CLIENT, _CLIENT_KEYS, "client keys"),
        ):
            tables = self.tables(array)
            if tables is None:
                # Not the value itself: it may hold secrets.
                found.append(self._error((array,), array, f"{what} are [[{array}]] tables"))
                continue
            for index, table in enumerate(tables):
                found += self._unknown_keys(table, (array, index), known, f"in [[{array}]]")
        return found

    def _unknown_keys(
        self, table: Mapping[str, Any], path: KeyPath, known: tuple[str, ...], where: str
    ) -> list[ConfigError]:
        found = []
        for key in table:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                expected = f"unknown key {where}" + (f" (did you mean {hint[0]}?)" if hint else "")
                expected += "; known keys: " + ", ".join(known)
                found.append(self._error((*path, key), key, expected))
        return found

    def _error(self, path: KeyPath, value: object, expected: str) -> ConfigError:
        key = ".".join(str(part) for part in path if isinstance(part, str))
        return ConfigError(key, value, expected, self.where(*path))


# --- Collecting mistakes --------------------------------------------------------------------------


class _Mistakes:
    """The errors found so far; ``resolve`` raises them all at the end."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def __len__(self) -> int:
        return len(self.found)

    def add(self, error: ConfigError) -> None:
        self.found.extend(error.errors if isinstance(error, ConfigErrors) else (error,))

    @contextlib.contextmanager
    def catch(self) -> Iterator[None]:
        """Record a ``ConfigError`` raised inside the block and go on after it."""
        try:
            yield
        except ConfigError as exc:
            self.add(exc)

    def raise_if_any(self, file: ConfigFile | None) -> None:
        """Raise the one error, or all of them: flags and environment first, then by line."""
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise ConfigErrors(sorted(self.found, key=lambda error: _line_of(error, file)))


def _line_of(error: ConfigError, file: ConfigFile | None) -> int:
    if file is None or not error.source.startswith(file.name):
        return 0
    line = error.source[len(file.name) :].removeprefix(":")
    return int(line) if line.isdigit() else 1


# --- Upstream nodes -------------------------------------------------------------------------------

_VAR_RE = re.compile(r"\$\{([^}]*)\}")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CLIENT_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z:-]{1,128}")  # as config.ClientKey takes


def expand_env(template: str, environ: Mapping[str, str]) -> str:
    """Replace every ``${VAR}`` in ``template`` with the variable's value.

    A ``$`` not followed by ``{`` stays as it is. A variable that is set but
    empty is refused like an unset one: both usually mean a secret that did
    not reach the proxy, and an empty credential only turns into a stream of
    ``401`` answers.

    Raises:
        ValueError: ``VAR`` is not set, is empty, is not a variable name, or
            a ``${`` is not closed. The message names the reference, never a value.
    """

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if not _VAR_NAME.fullmatch(name):
            raise ValueError(f"${{{name}}} is not a valid variable reference")
        if name not in environ:
            raise ValueError(f"environment variable {name} is not set")
        if not environ[name]:
            raise ValueError(f"environment variable {name} is empty")
        return environ[name]

    if "${" in _VAR_RE.sub("", template):
        raise ValueError("a ${ is not closed by }")
    return _VAR_RE.sub(substitute, template)


def _expand(template: str, environ: Mapping[str, str], whose: str) -> str:
    """``expand_env``, with errors that quote the references and say who needs them.

    Raises:
        ConfigError: with ``option`` and ``source`` for the caller to fill in.
    """
    try:
        return expand_env(template, environ)
    except ValueError as exc:
        refs = " ".join(f"${{{ref}}}" for ref in _VAR_RE.findall(template)) or "${"
        raise ConfigError("", refs, f"{exc}; {whose}") from None


@attrs.frozen
class _Node:
    """A node as one source gives it, with the capacity its own [[upstream]] table sets."""

    node: Upstream
    source: Source
    capacity: tuple[int, Source] | None = None


def _node_from_spec(spec: str, source: Source) -> Upstream:
    try:
        return Upstream.parse(spec)
    except ConfigError as exc:
        raise ConfigError("upstream", spec, exc.expected, source.where) from None


def _nodes_from_file(
    file: ConfigFile, environ: Mapping[str, str], mistakes: _Mistakes
) -> list[_Node] | None:
    """The file's nodes; None if any is wrong (each mistake is recorded, once)."""
    tables = file.tables(_UPSTREAM)
    if tables is None:
        return None  # a mistake of the file's layout, already in file.mistakes
    nodes = [
        _node_from_table(file, index, table, environ, mistakes)
        for index, table in enumerate(tables)
    ]
    return None if None in nodes else [node for node in nodes if node is not None]


def _node_label(table: Mapping[str, Any], index: int) -> str:
    """What to call a node in an error: its name, else its default name, else its position."""
    name, url = table.get("name"), table.get("url")
    if isinstance(name, str) and name:
        return name
    if isinstance(url, str):
        with contextlib.suppress(ConfigError):
            return Upstream.parse(url).name
    return f"number {index + 1}"


def _node_from_table(
    file: ConfigFile,
    index: int,
    table: Mapping[str, Any],
    environ: Mapping[str, str],
    mistakes: _Mistakes,
) -> _Node | None:
    """One [[upstream]] table as a node; None if it has mistakes (each one recorded)."""

    def error(key: str, value: object, expected: str, *sub: str) -> ConfigError:
        label = ".".join((_UPSTREAM, key, *sub))
        return ConfigError(label, value, expected, file.where(_UPSTREAM, index, key, *sub))

    before = len(mistakes)
    label = _node_label(table, index)
    url, name = table.get("url"), table.get("name")
    if url is None:
        mistakes.add(
            ConfigError(
                "upstream.url", "", "every [[upstream]] needs a url", file.where(_UPSTREAM, index)
            )
        )
    elif not isinstance(url, str):
        mistakes.add(error("url", url, 'expected a string such as "http://10.0.0.5:8000"'))
    if name is not None and not isinstance(name, str):
        mistakes.add(error("name", name, "expected a string"))

    models = table.get("models")
    with mistakes.catch():
        models = _table_models(models, error)
    headers = _table_headers(table.get("headers", {}), environ, f"node {label}", error, mistakes)

    ca_file = table.get("ca_file")
    if ca_file is not None:
        if not isinstance(ca_file, str):
            mistakes.add(error("ca_file", ca_file, "expected a file path"))
        else:
            try:
                _existing_file(ca_file)
            except ValueError as exc:
                mistakes.add(error("ca_file", ca_file, str(exc)))
    insecure = table.get("insecure_skip_verify", False)
    if not isinstance(insecure, bool):
        mistakes.add(error("insecure_skip_verify", insecure, "expected true or false"))

    capacity: tuple[int, Source] | None = None
    if _CAPACITY in table:
        raw = table[_CAPACITY]
        where = file.where(_UPSTREAM, index, _CAPACITY)
        try:
            capacity = (_capacity_toml(raw), Source("file", where, raw))
        except ValueError as exc:
            mistakes.add(error(_CAPACITY, raw, str(exc)))

    if not isinstance(url, str) or not isinstance(name, str | None):
        return None
    try:
        node = Upstream.parse(url) if name is None else Upstream(name, url)
    except ConfigError as exc:
        key = "name" if name is not None and exc.value == name else "url"
        mistakes.add(error(key, exc.value, exc.expected))
        return None
    if len(mistakes) > before:
        return None
    node = attrs.evolve(
        node, models=models, headers=headers, ca_file=ca_file, insecure_skip_verify=insecure
    )
    return _Node(node, Source("file", file.where(_UPSTREAM, index)), capacity)


def _table_models(models: object, error: Callable[..., ConfigError]) -> object:
    """A node's ``models`` value, checked (a lone string is a list of one)."""
    if models is None:
        return None
    if isinstance(models, str):
        models = [models]
    if isinstance(models, list):
        if not models or not all(isinstance(m, str) and m for m in models):
            raise error("models", models, "expected a non-empty list of model names")
    elif isinstance(models, Mapping):
        if not models or not all(isinstance(m, str) and m for m in models.values()):
            raise error(
                "models", models, 'expected a table of model names, such as {"*" = "qwen3"}'
            )
    else:
        raise error("models", models, "expected a list or a table of model names")
    return models


def _table_headers(
    raw_headers: object,
    environ: Mapping[str, str],
    whose: str,
    error: Callable[..., ConfigError],
    mistakes: _Mistakes,
) -> dict[str, str]:
    """A node's ``headers`` with ``${VAR}`` expanded; each bad header is one mistake."""
    headers: dict[str, str] = {}
    if not isinstance(raw_headers, Mapping):
        mistakes.add(error("headers", "...", "expected a table of header names and values"))
        return headers
    for header, template in raw_headers.items():
        if not _TOKEN.fullmatch(header):
            mistakes.add(error("headers", header, "not a valid header name", header))
            continue
        if not isinstance(template, str):
            mistakes.add(error("headers", header, "a header value must be a string", header))
            continue
        try:
            value = _expand(template, environ, f"{whose} needs it for its {header} header")
        except ConfigError as exc:
            mistakes.add(error("headers", exc.value, exc.expected, header))
            continue
        if any(char in value for char in "\r\n\0"):
            mistakes.add(
                error("headers", header, "a header value must not contain CR, LF or NUL", header)
            )
            continue
        headers[header] = value
    return headers


def _resolve_nodes(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None,
    sources: dict[str, Source],
    mistakes: _Mistakes,
) -> list[_Node] | None:
    """The node list from the highest-precedence source that has one; all are checked.

    Returns None when the list in force cannot be built (its mistakes recorded).
    """
    opt = _BY_NAME["upstream"]
    candidates: list[tuple[list[_Node] | None, Source]] = []

    specs = _flag_list(flags, opt)
    if specs:
        candidates.append(
            (_nodes_from_specs(specs, opt.flag, "flag", mistakes), Source("flag", opt.flag, specs))
        )
    if opt.env in environ:
        text = environ[opt.env]
        nodes = _nodes_from_specs(_comma_list(text), opt.env, "env", mistakes)
        candidates.append((nodes, Source("env", opt.env, text)))
    if file is not None and _UPSTREAM in file.data:
        nodes = _nodes_from_file(file, environ, mistakes)
        candidates.append((nodes, Source("file", file.where(_UPSTREAM, 0))))

    if not candidates:
        where = file.name if file is not None else opt.flag
        mistakes.add(
            ConfigError(
                "upstream",
                "",
                "at least one node is required: give --upstream, "
                f"{opt.env} or [[upstream]] tables in the config file",
                where,
            )
        )
        return None
    chosen, list_source = candidates[0]
    if chosen is None:
        return None
    if not chosen:
        mistakes.add(
            ConfigError(
                "upstream", list_source.raw, "at least one node is required", list_source.where
            )
        )
        return None

    seen: dict[str, Source] = {}
    before = len(mistakes)
    for entry in chosen:
        name, source = entry.node.name, entry.source
        if name in seen:
            label = "upstream.name" if source.kind == "file" else "upstream"
            mistakes.add(
                ConfigError(
                    label,
                    name,
                    f"node names must be unique; {name} is also at {seen[name].where}",
                    source.where,
                )
            )
        seen[name] = source
    if len(mistakes) > before:
        return None
    sources["upstreams"] = list_source
    for entry in chosen:
        sources[f"upstream:{entry.node.name}"] = entry.source
    return chosen


def _flag_list(flags: Mapping[str, object], opt: Option) -> list[str]:
    values = flags.get(opt.name)
    if not values:
        return []
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"{opt.name}: expected a list of strings, got {values!r}")
    return [str(value) for value in values]


def _nodes_from_specs(
    specs: list[str], where: str, kind: SourceKind, mistakes: _Mistakes
) -> list[_Node] | None:
    nodes: list[_Node] = []
    before = len(mistakes)
    for spec in specs:
        source = Source(kind, where, spec)
        with mistakes.catch():
            nodes.append(_Node(_node_from_spec(spec, source), source))
    return None if len(mistakes) > before else nodes


# --- Capacity -------------------------------------------------------------------------------------

_CAPACITY_EXPECTED = "expected N or NAME=N, N a whole number of attempts (0 = no limit)"


def _capacity_toml(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError("expected a whole number of attempts, 0 (no limit) or more")
    return value


@attrs.frozen
class _Capacity:
    """One capacity setting: for the node ``node``, or (None) for every node without its own."""

    node: str | None
    value: int
    source: Source


def _capacity_from_text(item: str, source: Source) -> _Capacity:
    name, sep, number = item.partition("=")
    if not sep:
        name, number = "", item
    name, number = name.strip(), number.strip()
    if (sep and not name) or not _DIGITS.fullmatch(number):
        raise ConfigError("capacity", item, _CAPACITY_EXPECTED, source.where)
    return _Capacity(name or None, int(number), source)


def _capacity_settings(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None,
    mistakes: _Mistakes,
) -> tuple[list[_Capacity], list[_Capacity], _Capacity | None]:
    """The settings of the flags, of the environment and the file's top-level one, all checked."""
    opt = _BY_NAME["capacity"]
    found: list[list[_Capacity]] = []
    lists: tuple[tuple[SourceKind, str, list[str]], ...] = (
        ("flag", opt.flag, _flag_list(flags, opt)),
        ("env", opt.env, [environ[opt.env]] if opt.env in environ else []),
    )
    for kind, where, specs in lists:
        settings: list[_Capacity] = []
        for spec in specs:
            items = _comma_list(spec)
            if not items and kind == "flag":
                mistakes.add(ConfigError("capacity", spec, _CAPACITY_EXPECTED, where))
            for item in items:
                with mistakes.catch():
                    settings.append(_capacity_from_text(item, Source(kind, where, item)))
        _refuse_repeats(settings, mistakes)
        found.append(settings)
    top: _Capacity | None = None
    raw = _MISSING if file is None else file._lookup((_CAPACITY,))
    if file is not None and raw is not _MISSING:
        where = file.where(_CAPACITY)
        try:
            top = _Capacity(None, _capacity_toml(raw), Source("file", where, raw))
        except ValueError as exc:
            mistakes.add(ConfigError(_CAPACITY, raw, str(exc), where))
    return found[0], found[1], top


def _refuse_repeats(settings: list[_Capacity], mistakes: _Mistakes) -> None:
    seen: set[str | None] = set()
    for setting in settings:
        if setting.node in seen:
            what = "for every other node" if setting.node is None else f"of {setting.node}"
            mistakes.add(
                ConfigError(
                    "capacity",
                    setting.source.raw,
                    f"the capacity {what} is given twice here",
                    setting.source.where,
                )
            )
        seen.add(setting.node)


def _resolve_capacity(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None,
    nodes: list[_Node] | None,
    sources: dict[str, Source],
    mistakes: _Mistakes,
) -> dict[str, int]:
    """Each node's capacity: the first that is set of, in this order (SPEC section 3),

    flag ``NAME=N``, env ``NAME=N``, the node's own ``capacity`` in the file,
    bare flag ``N``, bare env ``N``, the file's top-level ``capacity``, ``0``.
    The more specific value wins first, then the source: ``--capacity 2``
    on a command line does not undo a per-node limit written in the file.
    """
    from_flag, from_env, top = _capacity_settings(flags, environ, file, mistakes)
    if nodes is None:
        return {}
    names = [entry.node.name for entry in nodes]
    for setting in (*from_flag, *from_env):
        if setting.node is not None and setting.node not in names:
            mistakes.add(
                ConfigError(
                    "capacity",
                    setting.source.raw,
                    f"{setting.node} is no node; the nodes are " + ", ".join(names),
                    setting.source.where,
                )
            )
    named_flag = {s.node: s for s in from_flag if s.node is not None}
    named_env = {s.node: s for s in from_env if s.node is not None}
    bare_flag = next((s for s in from_flag if s.node is None), None)
    bare_env = next((s for s in from_env if s.node is None), None)
    capacities: dict[str, int] = {}
    for entry in nodes:
        name = entry.node.name
        tiers = (
            named_flag.get(name),
            named_env.get(name),
            None if entry.capacity is None else _Capacity(name, *entry.capacity),
            bare_flag,
            bare_env,
            top,
        )
        chosen = next((tier for tier in tiers if tier is not None), None)
        capacities[name] = 0 if chosen is None else chosen.value
        sources[f"capacity:{name}"] = DEFAULT if chosen is None else chosen.source
    return capacities


# --- Client keys ----------------------------------------------------------------------------------


def _client_from_spec(spec: str, position: int, source: Source) -> tuple[ClientKey, Source]:
    """``[NAME=]KEY`` as a client key; errors name the client, never the key."""
    name, sep, key = spec.partition("=")
    if not sep:
        name, key = "", spec
    name, key = name.strip(), key.strip()
    if sep and (not name or key.startswith("=") or not _CLIENT_NAME.fullmatch(name)):
        # Most likely an unnamed key that holds "=" (base64 padding): then
        # the "name" is a piece of the key, and must not be quoted.
        raise ConfigError(
            "api-key",
            f"key-{position}",
            "expected [NAME=]KEY with NAME 1-128 token characters; a key that holds = "
            "needs a name in front (NAME=KEY)",
            source.where,
        )
    label = name or f"key-{position}"
    try:
        return ClientKey(label, key), Source(source.kind, source.where, label)
    except ConfigError as exc:
        raise ConfigError("api-key", label, exc.expected, source.where) from None


def _clients_from_specs(
    specs: list[str], where: str, kind: SourceKind, mistakes: _Mistakes
) -> list[tuple[ClientKey, Source]] | None:
    clients: list[tuple[ClientKey, Source]] = []
    before = len(mistakes)
    for position, spec in enumerate(specs, start=1):
        with mistakes.catch():
            clients.append(_client_from_spec(spec, position, Source(kind, where)))
    return None if len(mistakes) > before else clients


def _clients_from_file(
    file: ConfigFile, environ: Mapping[str, str], mistakes: _Mistakes
) -> list[tuple[ClientKey, Source]] | None:
    """The file's [[client]] tables; None if any is wrong (each mistake recorded)."""
    tables = file.tables(_CLIENT)
    if tables is None:
        return None  # a mistake of the file's layout, already in file.mistakes
    clients: list[tuple[ClientKey, Source]] = []
    before = len(mistakes)
    for index, table in enumerate(tables):
        with mistakes.catch():
            clients.append(_client_from_table(file, index, table, environ))
    return None if len(mistakes) > before else clients


def _client_from_table(
    file: ConfigFile, index: int, table: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[ClientKey, Source]:
    name = table.get("name")
    if name is not None and not isinstance(name, str):
        raise ConfigError(
            "client.name", name, "expected a string", file.where(_CLIENT, index, "name")
        )
    label = name or f"key-{index + 1}"
    where = file.where(_CLIENT, index, "key")
    template = table.get("key")
    if template is None:
        raise ConfigError(
            "client.key", label, f"client {label} has no key", file.where(_CLIENT, index)
        )
    if not isinstance(template, str):
        raise ConfigError("client.key", label, f"the key of client {label} must be a string", where)
    try:
        key = _expand(template, environ, f"client {label} needs it for its key")
    except ConfigError as exc:
        raise ConfigError("client.key", exc.value, exc.expected, where) from None
    try:
        client = ClientKey(label, key)
    except ConfigError as exc:
        key_name = "client.name" if exc.expected.startswith("a client name") else "client.key"
        raise ConfigError(key_name, label, exc.expected, where) from None
    return client, Source("file", file.where(_CLIENT, index), label)


def _resolve_clients(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None,
    sources: dict[str, Source],
    mistakes: _Mistakes,
) -> tuple[ClientKey, ...]:
    """The client keys from the first source that has any (the list is never merged)."""
    opt = _BY_NAME["api_key"]
    candidates: list[tuple[list[tuple[ClientKey, Source]] | None, Source]] = []
    specs = _flag_list(flags, opt)
    if specs:
        clients = _clients_from_specs(specs, opt.flag, "flag", mistakes)
        candidates.append((clients, Source("flag", opt.flag, SECRET)))
    if opt.env in environ:
        items = _comma_list(environ[opt.env])
        if not items:
            # An empty list would turn the key checks off without a word.
            mistakes.add(
                ConfigError("api-key", "", "no key in it; unset the variable for no keys", opt.env)
            )
        clients = _clients_from_specs(items, opt.env, "env", mistakes)
        candidates.append((clients, Source("env", opt.env, SECRET)))
    if file is not None and _CLIENT in file.data:
        clients = _clients_from_file(file, environ, mistakes)
        candidates.append((clients, Source("file", file.where(_CLIENT, 0), SECRET)))
    sources["clients"] = DEFAULT
    if not candidates or candidates[0][0] is None:
        return ()
    chosen, sources["clients"] = candidates[0]
    assert chosen is not None
    names: dict[str, Source] = {}
    keys: dict[str, str] = {}
    for client, source in chosen:
        label = "client.name" if source.kind == "file" else "api-key"
        if client.name in names:
            mistakes.add(
                ConfigError(
                    label,
                    client.name,
                    f"client names must be unique; {client.name} is also at "
                    f"{names[client.name].where}",
                    source.where,
                )
            )
        elif client.key in keys:
            mistakes.add(
                ConfigError(
                    label.replace("name", "key"),
                    client.name,
                    f"client {client.name} has the same key as client {keys[client.key]}",
                    source.where,
                )
            )
        names.setdefault(client.name, source)
        keys.setdefault(client.key, client.name)
        sources[f"client:{client.name}"] = source
    return tuple(client for client, _ in chosen)


# --- Resolution -----------------------------------------------------------------------------------

_FIELDS = attrs.fields_dict(Config)


def _label(opt: Option, source: Source) -> str:
    return opt.toml_key if source.kind == "file" and opt.toml else opt.label


def _parse(opt: Option, raw: object, source: Source) -> Any:
    """One given value, parsed and checked by ``Config``'s own validator of its field.

    ``source.raw`` is what an error quotes (``***`` for a secret).
    """
    try:
        if source.kind == "file":
            value = opt.kind.from_toml(raw)
        elif not isinstance(raw, str):
            raise TypeError(f"{opt.name}: expected a string from {source.kind}, got {raw!r}")
        else:
            value = opt.kind.from_text(raw)
        attribute = _FIELDS[opt.field] if opt.field else None
        if attribute is not None and attribute.validator is not None:
            attribute.validator(None, attribute, value)
    except ValueError as exc:
        expected = exc.expected if isinstance(exc, ConfigError) else str(exc)
        raise ConfigError(_label(opt, source), source.raw, expected, source.where) from None
    return value


def _relabel(exc: ConfigError, sources: Mapping[str, Source]) -> ConfigError:
    """Give an error from ``Config``'s validators the user's option name and source."""
    opt = _BY_FIELD.get(exc.option)
    if opt is None or opt.field is None:
        return exc
    source = sources.get(opt.field, DEFAULT)
    value = exc.value if source.raw is None else source.raw
    return ConfigError(_label(opt, source), value, exc.expected, source.where or opt.flag)


def _config_source(
    flags: Mapping[str, object], environ: Mapping[str, str], file: ConfigFile | None
) -> Source:
    opt = _BY_NAME["config"]
    path = flags.get("config")
    if path is not None:
        return Source("flag", opt.flag, path)
    if opt.env in environ:
        return Source("env", opt.env, environ[opt.env])
    if file is not None:
        return Source("file", file.name, file.name)
    return DEFAULT


def _resolve_options(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None,
    sources: dict[str, Source],
    mistakes: _Mistakes,
) -> tuple[dict[str, Any], set[str]]:
    """The options of one value each (flag > env > file): the values, and the fields in error."""
    kwargs: dict[str, Any] = {}
    failed: set[str] = set()
    for opt in OPTIONS:
        if opt.field is None:
            continue
        raws: list[tuple[object, Source]] = []
        if flags.get(opt.name) is not None:
            raws.append((flags[opt.name], Source("flag", opt.flag, flags[opt.name])))
        if opt.env in environ:
            raws.append((environ[opt.env], Source("env", opt.env, environ[opt.env])))
        if file is not None and opt.toml is not None:
            raw = file._lookup(opt.toml)
            if raw is not _MISSING:
                raws.append((raw, Source("file", file.where(*opt.toml), raw)))
        given: list[tuple[Any, Source]] = []
        for raw, source in raws:
            if opt.secret:
                source = attrs.evolve(source, raw=SECRET)
            try:
                given.append((_parse(opt, raw, source), source))
            except ConfigError as exc:
                mistakes.add(exc)
                failed.add(opt.field)
        if given:
            kwargs[opt.field], sources[opt.field] = given[0]
        else:
            sources[opt.field] = DEFAULT
    return kwargs, failed


def resolve(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None = None,
) -> tuple[Config, dict[str, Source]]:
    """Build the ``Config`` from flags, environment and config file.

    Args:
        flags: option name (``OPTIONS[i].name``) to the text given on the
            command line; the ``repeat`` options (``upstream``, ``capacity``,
            ``api_key``) map to a list of strings. ``None`` or a missing key
            means "not given".
        environ: the environment (``os.environ``); read for the
            ``TRIO_FAILOVER_*`` variables and for ``${VAR}`` in node headers
            and client keys.
        file: an already parsed config file; by default the file named by
            ``--config`` or ``TRIO_FAILOVER_CONFIG`` is read, if any.

    Returns:
        The config and the source of every value: keyed by ``Config`` field
        name, plus ``"config"`` (the file), ``"upstreams"`` (the node list),
        ``"upstream:NAME"`` and ``"capacity:NAME"`` for each node,
        ``"clients"`` (the key list) and ``"client:NAME"`` for each client.

    Raises:
        ConfigError: a bad value, with ``source`` set to the flag, the
            environment variable or ``file:line``; ``ConfigErrors`` (a
            ``ConfigError`` too) when there are several, with every one of
            them. A config file that cannot be read or is not TOML stops
            the checks at once.
        TypeError: ``flags`` names an option that does not exist (a bug in
            the caller, not a user error).
    """
    unknown = sorted(set(flags) - set(_BY_NAME))
    if unknown:
        raise TypeError(f"unknown option names in flags: {', '.join(unknown)}")
    sources: dict[str, Source] = {"config": _config_source(flags, environ, file)}
    if file is None and sources["config"].raw is not None:
        file = ConfigFile.read(str(sources["config"].raw), sources["config"])

    mistakes = _Mistakes()
    for mistake in file.mistakes if file is not None else ():
        mistakes.add(mistake)
    kwargs, failed = _resolve_options(flags, environ, file, sources, mistakes)
    nodes = _resolve_nodes(flags, environ, file, sources, mistakes)
    capacities = _resolve_capacity(flags, environ, file, nodes, sources, mistakes)
    kwargs["clients"] = _resolve_clients(flags, environ, file, sources, mistakes)
    if not failed & {"tls_cert", "tls_key"}:
        with mistakes.catch():
            _check_tls_pair(kwargs, sources)
    mistakes.raise_if_any(file)
    assert nodes is not None  # else a mistake was recorded
    kwargs["upstreams"] = tuple(
        attrs.evolve(entry.node, capacity=capacities[entry.node.name]) for entry in nodes
    )
    try:
        config = Config(**kwargs)
    except ConfigError as exc:
        raise _relabel(exc, sources) from None
    return config, sources


def _check_tls_pair(kwargs: Mapping[str, Any], sources: Mapping[str, Source]) -> None:
    if (kwargs.get("tls_cert") is None) == (kwargs.get("tls_key") is None):
        return
    given_opt, missing = (
        ("tls_cert", "--tls-key") if "tls_cert" in kwargs else ("tls_key", "--tls-cert")
    )
    source = sources[given_opt]
    raise ConfigError(
        _label(_BY_NAME[given_opt], source),
        source.raw,
        f"TLS needs both a certificate and a key; give {missing} as well",
        source.where,
    )


# --- Showing the resolved settings ----------------------------------------------------------------


def _show_node(node: Upstream) -> str:
    text = redact_url(node.url)
    if node.models is not None:
        pairs = (k if k == v else f"{k}->{v}" for k, v in node.models.items())
        text += " models=" + ",".join(pairs)
    if node.headers:
        # Every header value is shown masked: they carry API keys, and a
        # `check` output ends up in tickets and chat logs.
        text += " headers=" + ",".join(f"{name}:{SECRET}" for name in node.headers)
    if node.ca_file is not None:
        text += f" ca_file={node.ca_file}"
    if node.insecure_skip_verify:
        text += " insecure_skip_verify"
    return text


def describe(config: Config, sources: Mapping[str, Source]) -> list[tuple[str, str, str]]:
    """Rows ``(option, value, source)`` of the resolved settings, secrets masked.

    One row per option, in ``OPTIONS`` order; one row per node in place of
    the ``upstream`` and the ``capacity`` options, one per client key (its
    value ``***``) in place of ``api-key``.
    """
    rows: list[tuple[str, str, str]] = []
    for opt in OPTIONS:
        if opt.name == "config":
            source = sources.get("config", DEFAULT)
            path = None if source.raw is None else str(source.raw)
            rows.append((opt.label, _show_path(path), str(source)))
        elif opt.name == "upstream":
            for node in config.upstreams:
                source = sources.get(f"upstream:{node.name}", DEFAULT)
                rows.append((f"upstream {node.name}", _show_node(node), str(source)))
        elif opt.name == "capacity":
            for node in config.upstreams:
                source = sources.get(f"capacity:{node.name}", DEFAULT)
                rows.append((f"capacity {node.name}", str(node.capacity), str(source)))
        elif opt.name == "api_key":
            for client in config.clients:
                source = sources.get(f"client:{client.name}", DEFAULT)
                rows.append((f"api-key {client.name}", SECRET, str(source)))
            if not config.clients:
                rows.append((opt.label, "none", str(sources.get("clients", DEFAULT))))
        elif opt.field is not None:
            value = opt.kind.show(getattr(config, opt.field))
            rows.append((opt.label, value, str(sources.get(opt.field, DEFAULT))))
    return rows
