"""The TOML config file: parsed, its unknown keys found, and the line of every key known.

``tomllib`` keeps no positions, so ``key_lines`` reads enough of TOML's key
grammar to say which line wrote which key: an error can then point at
``config.toml:12``.
"""

from __future__ import annotations

import bisect
import difflib
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ...core.errors import ConfigError
from .options import OPTIONS
from .sources import DEFAULT, Source

__all__ = ["CAPACITY", "CLIENT", "ENGINE", "MISSING", "UPSTREAM", "ConfigFile", "key_lines"]

_TIMEOUTS = "timeouts"
UPSTREAM = "upstream"
CLIENT = "client"
CAPACITY = "capacity"
ENGINE = "engine"
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
    CAPACITY,
    ENGINE,
)
_CLIENT_KEYS: tuple[str, ...] = (
    "name",
    "key",
    "weight",
    "priority",
    "max_in_flight",
    "rpm",
    "tpm",
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
MISSING = object()


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


def key_lines(text: str) -> dict[KeyPath, int]:
    """Map each key path (``("upstream", 1, "url")``) to the line that wrote it.

    Inside an inline value (``client = [ {...},`` then ``{...} ]`` on the
    next line, ``headers = { A = "1" }``) each element and key has the line
    it stands on.
    """
    lines: dict[KeyPath, int] = {}
    table: KeyPath = ()
    arrays: dict[tuple[str, ...], int] = {}  # [[name]] -> how many seen so far
    multiline: str | None = None
    starts = [0]  # the offset in text of each line's start
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    inside_until = 0  # lines up to this one are an inline value read already
    for number, line in enumerate(text.splitlines(), start=1):
        if number <= inside_until:
            continue
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
            if header.group(1) == "[[":
                # The array itself is first written here: an error about
                # the array as a whole ([[upstreams]], an unknown key) has
                # a line to point at, and sorts by it.
                lines.setdefault(table[:-1], number)
            continue
        key = _KEY_LINE.match(line)
        if key is not None:
            key_path = table + _split_key(key.group(1))
            lines.setdefault(key_path, number)
            rest = line[key.end() :]
            value = rest.lstrip()
            if value[:1] in ("[", "{"):
                start = starts[number - 1] + len(line) - len(value)
                end = _inline_value(text, start, key_path, lines, starts)
                inside_until = bisect.bisect_right(starts, end - 1)
                continue
            for quotes in ('"""', "'''"):
                if rest.count(quotes) % 2 == 1:
                    multiline = quotes
                    break
    return lines


_INLINE_KEY = re.compile(rf"({_DOTTED})[ \t]*=")
_BASIC_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"?')
_SCALAR = re.compile(r"[^,\]}\s#]+")


def _skip_scalar(text: str, pos: int) -> int:
    """Where the string, number, boolean or date at ``pos`` ends (one further at least)."""
    for quotes in ('"""', "'''"):
        if text.startswith(quotes, pos):
            end = text.find(quotes, pos + 3)
            return len(text) if end < 0 else end + 3
    if text[pos] == "'":
        end = text.find("'", pos + 1)
        return len(text) if end < 0 else end + 1
    match = _BASIC_STRING.match(text, pos) or _SCALAR.match(text, pos)
    return match.end() if match else pos + 1


def _inline_value(
    text: str, pos: int, path: KeyPath, lines: dict[KeyPath, int], starts: list[int]
) -> int:
    """Record the line of each element and key of the inline array or table at ``pos``.

    Returns the offset where the value ends. Each step moves on one
    character at least, so text that is not TOML ends it too (``tomllib``
    says what is wrong with it).
    """

    def line_at(offset: int) -> int:
        return bisect.bisect_right(starts, offset)

    stack: list[tuple[str, KeyPath, int]] = []  # each open "[" or "{": its path, elements seen
    expecting: KeyPath | None = path  # the path of the value that starts next
    while pos < len(text):
        char = text[pos]
        if char in " \t\r\n,":
            pos += 1
            continue
        if char == "#":
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
            continue
        if expecting is None:
            kind, outer, count = stack[-1]
            if char in "]}":
                stack.pop()
                pos += 1
                if not stack:
                    return pos
                continue
            if kind == "{":
                key = _INLINE_KEY.match(text, pos)
                if key is None:
                    return pos
                expecting = outer + _split_key(key.group(1))
                lines.setdefault(expecting, line_at(pos))
                pos = key.end()
                continue
            stack[-1] = (kind, outer, count + 1)
            expecting = (*outer, count)
            lines.setdefault(expecting, line_at(pos))
        if char in "[{":
            stack.append((char, expecting, 0))
            pos += 1
        else:
            pos = _skip_scalar(text, pos)
            if not stack:
                return pos
        expecting = None
    return pos


def _words(key: str) -> tuple[str, ...]:
    return tuple(word for word in re.split(r"[_\W]+", key.lower()) if word)


def _spelled(key: str) -> tuple[str, ...]:
    """The words of ``key``, less a ``_timeout`` ending as the flags have it."""
    words = _words(key)
    if words[-1:] == ("timeout",) and len(words) > 1:
        words = words[:-1]
    return words


def _by_words(key: str, known: Sequence[str]) -> str | None:
    """The same key in another spelling, else the first known key with every word of ``key``."""
    words = _spelled(key)
    spelled = "_".join(words)
    if spelled in known:
        return spelled
    if words:
        for candidate in known:
            if set(words) <= set(_words(candidate)):
                return candidate
    return None


def _by_letters(key: str, known: Sequence[str]) -> str | None:
    hint = difflib.get_close_matches("_".join(_spelled(key)) or key, known, n=1)
    return hint[0] if hint else None


def _closest(key: str, known: Sequence[str]) -> str | None:
    """The known key a mistyped ``key`` most likely meant, if any.

    In this order: the same key in another spelling (case, dashes, a
    ``_timeout`` ending as the flags have it); the first known key, in
    the table's order, that has every word of ``key`` (``header`` ->
    ``response_header``, where the letters alone would say ``dead_peer``);
    else the closest by its letters.
    """
    return _by_words(key, known) or _by_letters(key, known)


def suggest_key(key: str, known: Sequence[str], *, top_level: bool = False) -> str | None:
    """What to suggest for an unknown ``key`` of a table whose keys are ``known``.

    At the top level a timeout's name points into ``[timeouts]``
    (``response_header_timeout`` -> ``response_header in [timeouts]``), and
    so does a misspelt one (``respone_header``) whose letters are closer
    to a timeout than to any top-level key; an array of tables is named as
    it is written (``[[upstream]]``).
    """
    if not top_level:
        return _closest(key, known)
    words = _words(key)
    timeouts = f" in [{_TIMEOUTS}]"
    if (words[-1:] == ("timeout",) and len(words) > 1) or "_".join(words) in _TIMEOUT_KEYS:
        timeout = _closest(key, _TIMEOUT_KEYS)
        if timeout is not None:
            return timeout + timeouts
    hint = _by_words(key, known)
    if hint is None:
        hint = _by_words(key, _TIMEOUT_KEYS)
        if hint is not None:
            return hint + timeouts
        # By its letters, among both tables' keys: the closest wins.
        others = [timeout for timeout in _TIMEOUT_KEYS if timeout not in known]
        hint = _by_letters(key, [*known, *others])
        if hint in others:
            return hint + timeouts
    if hint in (UPSTREAM, CLIENT):
        return f"[[{hint}]]"
    if hint == _TIMEOUTS:
        return f"[{_TIMEOUTS}]"
    return hint


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
        file = cls(name, data, key_lines(text))
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

    def lookup(self, path: Sequence[str]) -> object:
        """The value at ``path``, or the ``MISSING`` sentinel."""
        node: object = self.data
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                return MISSING
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
            (UPSTREAM, _NODE_KEYS, "nodes"),
            (CLIENT, _CLIENT_KEYS, "client keys"),
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
                hint = suggest_key(key, known, top_level=not path)
                expected = f"unknown key {where}" + (f" (did you mean {hint}?)" if hint else "")
                expected += "; known keys: " + ", ".join(known)
                found.append(self._error((*path, key), key, expected))
        return found

    def _error(self, path: KeyPath, value: object, expected: str) -> ConfigError:
        key = ".".join(str(part) for part in path if isinstance(part, str))
        return ConfigError(key, value, expected, self.where(*path))
