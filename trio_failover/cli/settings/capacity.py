"""Per-node settings: each node's capacity and engine (per-node values beat bare defaults).

``--capacity`` and ``--engine`` take ``NAME=VALUE`` for one node and a bare
``VALUE`` for the rest, from flags (repeat, or comma-separate), the
environment and the file (the node's own key, and a top-level default).
Per node, the first that is set wins (docs/configuration.md#capacity): flag
``NAME=V``, env ``NAME=V``, the node's key in the file, bare flag, bare env,
the file's top-level key, the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from ...core.engines import ENGINE_KINDS, EngineKind
from ...core.errors import ConfigError
from .given import Given
from .kinds import DIGITS, capacity_toml, comma_list, engine_toml, expected_of
from .nodes import Node
from .options import BY_NAME
from .sources import DEFAULT, Mistakes, Source, SourceKind
from .toml_file import CAPACITY, ENGINE, MISSING

__all__ = ["resolve_capacity", "resolve_engines"]

AUTO = "auto"
_CAPACITY_EXPECTED = (
    "expected N, auto, NAME=N or NAME=auto, N a whole number of attempts (0 = no limit)"
)
_ENGINE_EXPECTED = "expected NAME=KIND or KIND, KIND one of " + ", ".join(ENGINE_KINDS)


@attrs.frozen
class _Setting:
    """One setting: for the node ``node``, or (None) for every node without its own."""

    node: str | None
    value: Any
    source: Source


@attrs.frozen
class _PerNode:
    """How one per-node option is read: its option, file key, parsers and default."""

    option: str
    key: str
    expected: str
    from_text: Callable[[str], Any]  # raises ValueError
    from_toml: Callable[[object], Any]  # raises ValueError
    default: Any
    own: Callable[[Node], tuple[Any, Source] | None]


def _capacity_text(text: str) -> int | None:
    if text == AUTO:
        return None
    if not DIGITS.fullmatch(text):
        raise ValueError(_CAPACITY_EXPECTED)
    return int(text)


def _engine_text(text: str) -> str:
    if text not in ENGINE_KINDS:
        raise ValueError(_ENGINE_EXPECTED)
    return text


_CAPACITY = _PerNode(
    "capacity",
    CAPACITY,
    _CAPACITY_EXPECTED,
    _capacity_text,
    capacity_toml,
    None,
    lambda n: n.capacity,
)
_ENGINE = _PerNode(
    "engine",
    ENGINE,
    _ENGINE_EXPECTED,
    _engine_text,
    engine_toml,
    EngineKind.AUTO.value,
    lambda n: n.engine,
)


def _from_text(what: _PerNode, item: str, source: Source) -> _Setting:
    name, sep, value = item.partition("=")
    if not sep:
        name, value = "", item
    name, value = name.strip(), value.strip()
    try:
        if sep and not name:
            raise ValueError(what.expected)
        parsed = what.from_text(value)
    except ValueError:
        raise ConfigError(what.option, item, what.expected, source.where) from None
    return _Setting(name or None, parsed, source)


def _settings(
    what: _PerNode, given: Given, mistakes: Mistakes
) -> tuple[list[_Setting], list[_Setting], _Setting | None]:
    """The settings of the flags, of the environment and the file's top-level one, all checked."""
    opt = BY_NAME[what.option]
    found: list[list[_Setting]] = []
    lists: tuple[tuple[SourceKind, str, list[str]], ...] = (
        ("flag", opt.flag, given.flag_list(opt)),
        ("env", opt.env, [given.environ[opt.env]] if opt.env in given.environ else []),
    )
    for kind, where, specs in lists:
        settings: list[_Setting] = []
        for spec in specs:
            items = comma_list(spec)
            if not items and kind == "flag":
                mistakes.add(ConfigError(what.option, spec, what.expected, where))
            for item in items:
                with mistakes.catch():
                    settings.append(_from_text(what, item, Source(kind, where, item)))
        _refuse_repeats(what, settings, mistakes)
        found.append(settings)
    top: _Setting | None = None
    file = given.file
    raw = MISSING if file is None else file.lookup((what.key,))
    if file is not None and raw is not MISSING:
        where = file.where(what.key)
        try:
            top = _Setting(None, what.from_toml(raw), Source("file", where, raw))
        except ValueError as exc:
            mistakes.add(ConfigError(what.key, raw, expected_of(exc, what.key), where))
    return found[0], found[1], top


def _refuse_repeats(what: _PerNode, settings: list[_Setting], mistakes: Mistakes) -> None:
    seen: set[str | None] = set()
    for setting in settings:
        if setting.node in seen:
            whose = "for every other node" if setting.node is None else f"of {setting.node}"
            mistakes.add(
                ConfigError(
                    what.option,
                    setting.source.raw,
                    f"the {what.option} {whose} is given twice here",
                    setting.source.where,
                )
            )
        seen.add(setting.node)


def _resolve(
    what: _PerNode,
    given: Given,
    nodes: list[Node] | None,
    sources: dict[str, Source],
    mistakes: Mistakes,
) -> dict[str, Any]:
    from_flag, from_env, top = _settings(what, given, mistakes)
    if nodes is None:
        return {}
    names = [entry.node.name for entry in nodes]
    for setting in (*from_flag, *from_env):
        if setting.node is not None and setting.node not in names:
            mistakes.add(
                ConfigError(
                    what.option,
                    setting.source.raw,
                    f"{setting.node} is no node; the nodes are " + ", ".join(names),
                    setting.source.where,
                )
            )
    named_flag = {s.node: s for s in from_flag if s.node is not None}
    named_env = {s.node: s for s in from_env if s.node is not None}
    bare_flag = next((s for s in from_flag if s.node is None), None)
    bare_env = next((s for s in from_env if s.node is None), None)
    values: dict[str, Any] = {}
    for entry in nodes:
        name = entry.node.name
        own = what.own(entry)
        tiers = (
            named_flag.get(name),
            named_env.get(name),
            None if own is None else _Setting(name, *own),
            bare_flag,
            bare_env,
            top,
        )
        chosen = next((tier for tier in tiers if tier is not None), None)
        values[name] = what.default if chosen is None else chosen.value
        sources[f"{what.option}:{name}"] = DEFAULT if chosen is None else chosen.source
    return values


def resolve_capacity(
    given: Given,
    nodes: list[Node] | None,
    sources: dict[str, Source],
    mistakes: Mistakes,
) -> dict[str, int | None]:
    """Each node's capacity (None: ``auto``): the first that is set of, in this order,

    flag ``NAME=N``, env ``NAME=N``, the node's own ``capacity`` in the file,
    bare flag ``N``, bare env ``N``, the file's top-level ``capacity``,
    ``auto``. The more specific value wins first, then the source:
    ``--capacity 2`` on a command line does not undo a per-node limit
    written in the file. ``auto`` is a value like a number (``a=auto``
    undoes a bare ``--capacity 4`` for node ``a``).
    """
    values: dict[str, int | None] = _resolve(_CAPACITY, given, nodes, sources, mistakes)
    return values


def resolve_engines(
    given: Given,
    nodes: list[Node] | None,
    sources: dict[str, Source],
    mistakes: Mistakes,
) -> dict[str, str]:
    """Each node's engine kind, by the same precedence as capacity; default ``auto``."""
    values: dict[str, str] = _resolve(_ENGINE, given, nodes, sources, mistakes)
    return values
