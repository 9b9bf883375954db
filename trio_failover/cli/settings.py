"""Settings: the table of options and their resolution from four sources.

Every option is one row of ``OPTIONS``: its flag, its environment variable,
its key in the TOML file, how text and TOML values are parsed and how the
value is shown. ``resolve`` reads the flags, the environment and the config
file, applies the precedence flag > environment > file > default, builds the
``Config`` and returns, next to it, the ``Source`` of every value.

Two rules shape the errors:

- Every value that is given is checked, even one that a higher-precedence
  source overrides: a broken line in the config file should not wait for the
  day somebody drops the flag that hid it.
- A ``ConfigError`` always names the option as the user wrote it (``--flag``
  name, or TOML key), the source (``--first-body-timeout``,
  ``TRIO_FAILOVER_FIRST_BODY_TIMEOUT`` or ``config.toml:12``), the value as
  given (never a header value, which may be a secret) and what was expected.
  ``Config``'s own validators only know attribute names; their errors are
  relabelled here.

This module reads the config file but imports neither trio nor time.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from ..core.config import (
    AFFINITY_CHOICES,
    CLIENT_CLOSE_CHOICES,
    LOG_FORMAT_CHOICES,
    LOG_LEVEL_CHOICES,
    Config,
    Upstream,
    redact_url,
    split_host_port,
)
from ..core.errors import ConfigError
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
    except ConfigError:
        raise ValueError("expected HOST:PORT with a port from 0 to 65535, or off") from None


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
    if type(item) is int and 100 <= item <= 599:
        return item
    raise ValueError(f"{item!r} is not an HTTP status code (100-599)")


def _statuses_text(text: str) -> frozenset[int]:
    statuses: set[int] = set()
    for item in _comma_list(text):
        try:
            number = int(item)
        except ValueError:
            raise ValueError(f"{item!r} is not an HTTP status code (100-599)") from None
        statuses.add(_status(number))
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
# --config and --upstream are read by resolve() itself; these kinds only show them.
CONFIG_PATH = Kind("path", str, str, _show_path)
NODES = Kind("nodes", str, str, str)


def _choice_kind(choices: tuple[str, ...], *, fold_case: bool = False) -> Kind:
    parse = _choice(choices, fold_case=fold_case)
    expected = "one of " + ", ".join(choices)
    return Kind("|".join(choices), parse, _toml_str(parse, expected), str)


# --- The option table ----------------------------------------------------------------------------


@attrs.frozen
class Option:
    """One setting: its flag, environment variable, TOML key, parser and help.

    ``name`` is the key in the ``flags`` mapping given to ``resolve`` (and the
    CLI's parameter name); ``field`` the ``Config`` attribute it sets.
    """

    name: str
    flag: str
    toml: tuple[str, ...] | None
    kind: Kind
    metavar: str
    help: str
    field: str | None = None
    env: str = ""

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
    )


_CLIENT_CLOSE = _choice_kind(CLIENT_CLOSE_CHOICES)
_AFFINITY = _choice_kind(AFFINITY_CHOICES)
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
            field=None, env=ENV_PREFIX + "UPSTREAMS"),
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
_TOP_KEYS: tuple[str, ...] = (
    *(opt.toml[0] for opt in OPTIONS if opt.toml and len(opt.toml) == 1),
    _TIMEOUTS,
)  # includes "upstream"
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
)

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
    """A parsed TOML config file that knows on which line each key was written."""

    name: str
    data: Mapping[str, Any]
    lines: Mapping[KeyPath, int] = attrs.field(factory=dict, repr=False)

    @classmethod
    def parse(cls, text: str, name: str = "config.toml") -> ConfigFile:
        """Parse TOML text and check it has no unknown keys.

        Raises:
            ConfigError: a syntax error or an unknown key, with ``name:line``
                as the source.
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
        file._check_keys()
        return file

    @classmethod
    def read(cls, path: str, source: Source = DEFAULT) -> ConfigFile:
        """Read and parse the file at ``path``; ``source`` says who named it.

        Raises:
            ConfigError: the file is unreadable, not UTF-8, not TOML or has
                unknown keys.
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

    def _check_keys(self) -> None:
        self._check_table(self.data, (), _TOP_KEYS, "at the top level")
        timeouts = self.data.get(_TIMEOUTS, {})
        if not isinstance(timeouts, Mapping):
            raise self._error((_TIMEOUTS,), timeouts, "expected a [timeouts] table")
        self._check_table(timeouts, (_TIMEOUTS,), _TIMEOUT_KEYS, "in [timeouts]")
        nodes = self.data.get(_UPSTREAM, [])
        if not isinstance(nodes, list) or not all(isinstance(n, Mapping) for n in nodes):
            # Not the value itself: it may hold header secrets.
            raise self._error((_UPSTREAM,), _UPSTREAM, "nodes are [[upstream]] tables")
        for index, node in enumerate(nodes):
            self._check_table(node, (_UPSTREAM, index), _NODE_KEYS, "in [[upstream]]")

    def _check_table(
        self, table: Mapping[str, Any], path: KeyPath, known: tuple[str, ...], where: str
    ) -> None:
        for key in table:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                expected = f"unknown key {where}" + (f" (did you mean {hint[0]}?)" if hint else "")
                expected += "; known keys: " + ", ".join(known)
                raise self._error((*path, key), key, expected)

    def _error(self, path: KeyPath, value: object, expected: str) -> ConfigError:
        key = ".".join(str(part) for part in path if isinstance(part, str))
        return ConfigError(key, value, expected, self.where(*path))


# --- Upstream nodes -------------------------------------------------------------------------------

_VAR_RE = re.compile(r"\$\{([^}]*)\}")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def expand_env(template: str, environ: Mapping[str, str]) -> str:
    """Replace every ``${VAR}`` in ``template`` with the variable's value.

    A ``$`` not followed by ``{`` stays as it is.

    Raises:
        ValueError: ``VAR`` is not set, is not a variable name, or a ``${``
            is not closed. The message names the reference, never a value.
    """

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if not _VAR_NAME.fullmatch(name):
            raise ValueError(f"${{{name}}} is not a valid variable reference")
        if name not in environ:
            raise ValueError(f"environment variable {name} is not set")
        return environ[name]

    if "${" in _VAR_RE.sub("", template):
        raise ValueError("a ${ is not closed by }")
    return _VAR_RE.sub(substitute, template)


def _node_from_spec(spec: str, source: Source) -> Upstream:
    try:
        return Upstream.parse(spec)
    except ConfigError as exc:
        raise ConfigError("upstream", spec, exc.expected, source.where) from None


def _nodes_from_file(file: ConfigFile, environ: Mapping[str, str]) -> list[tuple[Upstream, Source]]:
    return [
        (
            _node_from_table(file, index, table, environ),
            Source("file", file.where(_UPSTREAM, index)),
        )
        for index, table in enumerate(file.data.get(_UPSTREAM, []))
    ]


def _node_from_table(
    file: ConfigFile, index: int, table: Mapping[str, Any], environ: Mapping[str, str]
) -> Upstream:
    def error(key: str, value: object, expected: str, *sub: str) -> ConfigError:
        label = ".".join((_UPSTREAM, key, *sub))
        return ConfigError(label, value, expected, file.where(_UPSTREAM, index, key, *sub))

    url = table.get("url")
    if url is None:
        raise ConfigError(
            "upstream.url", "", "every [[upstream]] needs a url", file.where(_UPSTREAM, index)
        )
    if not isinstance(url, str):
        raise error("url", url, 'expected a string such as "http://10.0.0.5:8000"')
    name = table.get("name")
    if name is not None and not isinstance(name, str):
        raise error("name", name, "expected a string")

    models = table.get("models")
    if models is not None:
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

    headers: dict[str, str] = {}
    raw_headers = table.get("headers", {})
    if not isinstance(raw_headers, Mapping):
        raise error("headers", "...", "expected a table of header names and values")
    for header, template in raw_headers.items():
        if not _TOKEN.fullmatch(header):
            raise error("headers", header, "not a valid header name", header)
        if not isinstance(template, str):
            raise error("headers", header, "a header value must be a string", header)
        try:
            value = expand_env(template, environ)
        except ValueError as exc:
            refs = " ".join(f"${{{ref}}}" for ref in _VAR_RE.findall(template)) or "${"
            raise error("headers", refs, str(exc), header) from None
        if any(char in value for char in "\r\n\0"):
            raise error("headers", header, "a header value must not contain CR, LF or NUL", header)
        headers[header] = value

    ca_file = table.get("ca_file")
    if ca_file is not None:
        if not isinstance(ca_file, str):
            raise error("ca_file", ca_file, "expected a file path")
        try:
            _existing_file(ca_file)
        except ValueError as exc:
            raise error("ca_file", ca_file, str(exc)) from None
    insecure = table.get("insecure_skip_verify", False)
    if not isinstance(insecure, bool):
        raise error("insecure_skip_verify", insecure, "expected true or false")

    try:
        node = Upstream.parse(url) if name is None else Upstream(name, url)
    except ConfigError as exc:
        key = "name" if name is not None and exc.value == name else "url"
        raise error(key, exc.value, exc.expected) from None
    return attrs.evolve(
        node, models=models, headers=headers, ca_file=ca_file, insecure_skip_verify=insecure
    )


# --- Resolution -----------------------------------------------------------------------------------


def _label(opt: Option, source: Source) -> str:
    return opt.toml_key if source.kind == "file" and opt.toml else opt.label


def _parse(opt: Option, raw: object, source: Source) -> Any:
    try:
        if source.kind == "file":
            return opt.kind.from_toml(raw)
        if not isinstance(raw, str):
            raise TypeError(f"{opt.name}: expected a string from {source.kind}, got {raw!r}")
        return opt.kind.from_text(raw)
    except ValueError as exc:
        expected = exc.expected if isinstance(exc, ConfigError) else str(exc)
        raise ConfigError(_label(opt, source), raw, expected, source.where) from None


def _relabel(exc: ConfigError, sources: Mapping[str, Source]) -> ConfigError:
    """Give an error from ``Config``'s validators the user's option name and source."""
    opt = _BY_FIELD.get(exc.option)
    if opt is None or opt.field is None:
        return exc
    source = sources.get(opt.field, DEFAULT)
    value = exc.value if source.raw is None else source.raw
    return ConfigError(_label(opt, source), value, exc.expected, source.where or opt.flag)


def resolve(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None = None,
) -> tuple[Config, dict[str, Source]]:
    """Build the ``Config`` from flags, environment and config file.

    Args:
        flags: option name (``OPTIONS[i].name``) to the text given on the
            command line; ``upstream`` maps to a list of ``[NAME=]URL``.
            ``None`` or a missing key means "not given".
        environ: the environment (``os.environ``); read for the
            ``TRIO_FAILOVER_*`` variables and for ``${VAR}`` in node headers.
        file: an already parsed config file; by default the file named by
            ``--config`` or ``TRIO_FAILOVER_CONFIG`` is read, if any.

    Returns:
        The config and the source of every value: keyed by ``Config`` field
        name, plus ``"config"`` (the file), ``"upstreams"`` (the node list)
        and ``"upstream:NAME"`` for each node.

    Raises:
        ConfigError: any bad value, with ``source`` set to the flag, the
            environment variable or ``file:line``.
        TypeError: ``flags`` names an option that does not exist (a bug in
            the caller, not a user error).
    """
    unknown = sorted(set(flags) - set(_BY_NAME))
    if unknown:
        raise TypeError(f"unknown option names in flags: {', '.join(unknown)}")
    sources: dict[str, Source] = {}

    config_opt = _BY_NAME["config"]
    config_path = flags.get("config")
    if config_path is not None:
        sources["config"] = Source("flag", config_opt.flag, config_path)
    elif config_opt.env in environ:
        sources["config"] = Source("env", config_opt.env, environ[config_opt.env])
    elif file is not None:
        sources["config"] = Source("file", file.name, file.name)
    else:
        sources["config"] = DEFAULT
    if file is None and sources["config"].raw is not None:
        file = ConfigFile.read(str(sources["config"].raw), sources["config"])

    kwargs: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.field is None:
            continue
        given: list[tuple[Any, Source]] = []
        if flags.get(opt.name) is not None:
            source = Source("flag", opt.flag, flags[opt.name])
            given.append((_parse(opt, source.raw, source), source))
        if opt.env in environ:
            source = Source("env", opt.env, environ[opt.env])
            given.append((_parse(opt, source.raw, source), source))
        if file is not None and opt.toml is not None:
            raw = file._lookup(opt.toml)
            if raw is not _MISSING:
                source = Source("file", file.where(*opt.toml), raw)
                given.append((_parse(opt, raw, source), source))
        if given:
            kwargs[opt.field], sources[opt.field] = given[0]
        else:
            sources[opt.field] = DEFAULT

    nodes = _resolve_nodes(flags, environ, file, sources)
    if (kwargs.get("tls_cert") is None) != (kwargs.get("tls_key") is None):
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
    kwargs["upstreams"] = tuple(nodes)
    try:
        config = Config(**kwargs)
    except ConfigError as exc:
        raise _relabel(exc, sources) from None
    return config, sources


def _resolve_nodes(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None,
    sources: dict[str, Source],
) -> list[Upstream]:
    """The node list from the highest-precedence source that has one; all are checked."""
    opt = _BY_NAME["upstream"]
    candidates: list[tuple[list[tuple[Upstream, Source]], Source]] = []

    specs = flags.get("upstream")
    if specs:
        if isinstance(specs, str) or not isinstance(specs, Sequence):
            raise TypeError(f"upstream: expected a list of strings, got {specs!r}")
        nodes = []
        for spec in specs:
            source = Source("flag", opt.flag, spec)
            nodes.append((_node_from_spec(str(spec), source), source))
        candidates.append((nodes, Source("flag", opt.flag, list(specs))))
    if opt.env in environ:
        text = environ[opt.env]
        source = Source("env", opt.env, text)
        nodes = [(_node_from_spec(spec, source), source) for spec in _comma_list(text)]
        candidates.append((nodes, source))
    if file is not None and _UPSTREAM in file.data:
        nodes = _nodes_from_file(file, environ)
        candidates.append((nodes, Source("file", file.where(_UPSTREAM, 0))))

    if not candidates:
        where = file.name if file is not None else opt.flag
        raise ConfigError(
            "upstream",
            "",
            "at least one node is required: give --upstream, "
            f"{opt.env} or [[upstream]] tables in the config file",
            where,
        )
    chosen, list_source = candidates[0]
    if not chosen:
        raise ConfigError(
            "upstream", list_source.raw, "at least one node is required", list_source.where
        )

    seen: dict[str, Source] = {}
    for node, source in chosen:
        if node.name in seen:
            label = "upstream.name" if source.kind == "file" else "upstream"
            raise ConfigError(
                label,
                node.name,
                f"node names must be unique; {node.name} is also at {seen[node.name].where}",
                source.where,
            )
        seen[node.name] = source
    sources["upstreams"] = list_source
    for node, source in chosen:
        sources[f"upstream:{node.name}"] = source
    return [node for node, _ in chosen]


# --- Showing the resolved settings ----------------------------------------------------------------

SECRET = "***"


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

    One row per option, in ``OPTIONS`` order, and one row per node in place
    of the ``upstream`` option.
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
        elif opt.field is not None:
            value = opt.kind.show(getattr(config, opt.field))
            rows.append((opt.label, value, str(sources.get(opt.field, DEFAULT))))
    return rows
