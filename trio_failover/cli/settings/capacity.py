"""Each node's capacity: per-node values beat bare defaults, then flag > env > file."""

from __future__ import annotations

import attrs

from ...core.errors import ConfigError
from .given import Given
from .kinds import DIGITS, capacity_toml, comma_list, expected_of
from .nodes import Node
from .options import BY_NAME
from .sources import DEFAULT, Mistakes, Source, SourceKind
from .toml_file import CAPACITY, MISSING

__all__ = ["resolve_capacity"]

_CAPACITY_EXPECTED = "expected N or NAME=N, N a whole number of attempts (0 = no limit)"


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
    if (sep and not name) or not DIGITS.fullmatch(number):
        raise ConfigError("capacity", item, _CAPACITY_EXPECTED, source.where)
    return _Capacity(name or None, int(number), source)


def _capacity_settings(
    given: Given, mistakes: Mistakes
) -> tuple[list[_Capacity], list[_Capacity], _Capacity | None]:
    """The settings of the flags, of the environment and the file's top-level one, all checked."""
    opt = BY_NAME["capacity"]
    found: list[list[_Capacity]] = []
    lists: tuple[tuple[SourceKind, str, list[str]], ...] = (
        ("flag", opt.flag, given.flag_list(opt)),
        ("env", opt.env, [given.environ[opt.env]] if opt.env in given.environ else []),
    )
    for kind, where, specs in lists:
        settings: list[_Capacity] = []
        for spec in specs:
            items = comma_list(spec)
            if not items and kind == "flag":
                mistakes.add(ConfigError("capacity", spec, _CAPACITY_EXPECTED, where))
            for item in items:
                with mistakes.catch():
                    settings.append(_capacity_from_text(item, Source(kind, where, item)))
        _refuse_repeats(settings, mistakes)
        found.append(settings)
    top: _Capacity | None = None
    file = given.file
    raw = MISSING if file is None else file.lookup((CAPACITY,))
    if file is not None and raw is not MISSING:
        where = file.where(CAPACITY)
        try:
            top = _Capacity(None, capacity_toml(raw), Source("file", where, raw))
        except ValueError as exc:
            mistakes.add(ConfigError(CAPACITY, raw, expected_of(exc, CAPACITY), where))
    return found[0], found[1], top


def _refuse_repeats(settings: list[_Capacity], mistakes: Mistakes) -> None:
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


def resolve_capacity(
    given: Given,
    nodes: list[Node] | None,
    sources: dict[str, Source],
    mistakes: Mistakes,
) -> dict[str, int]:
    """Each node's capacity: the first that is set of, in this order (SPEC section 3),

    flag ``NAME=N``, env ``NAME=N``, the node's own ``capacity`` in the file,
    bare flag ``N``, bare env ``N``, the file's top-level ``capacity``, ``0``.
    The more specific value wins first, then the source: ``--capacity 2``
    on a command line does not undo a per-node limit written in the file.
    """
    from_flag, from_env, top = _capacity_settings(given, mistakes)
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
