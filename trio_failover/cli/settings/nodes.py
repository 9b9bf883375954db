"""The node list: from ``--upstream`` specs or ``[[upstream]]`` tables, each checked.

The list is taken whole from the first source that has one (flag,
environment, file); every source's list is checked all the same.
"""

from __future__ import annotations

import contextlib
import re
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ...core.config import Upstream
from ...core.errors import ConfigError
from .expand import expand
from .given import Given
from .kinds import capacity_toml, comma_list, engine_toml, existing_file, expected_of
from .options import BY_NAME
from .sources import Mistakes, Source, SourceKind
from .toml_file import CAPACITY, ENGINE, UPSTREAM, ConfigFile

__all__ = ["Node", "resolve_nodes"]

# RFC 9110 token characters: what a header name may be.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


@attrs.frozen
class Node:
    """A node as one source gives it, with the capacity and engine its [[upstream]] table sets."""

    node: Upstream
    source: Source
    capacity: tuple[int | None, Source] | None = None
    engine: tuple[str, Source] | None = None


def _node_from_spec(spec: str, source: Source) -> Upstream:
    try:
        return Upstream.parse(spec)
    except ConfigError as exc:
        raise ConfigError("upstream", spec, exc.expected, source.where) from None


def _nodes_from_file(
    file: ConfigFile, environ: Mapping[str, str], mistakes: Mistakes
) -> list[Node] | None:
    """The file's nodes; None if any is wrong (each mistake is recorded, once)."""
    tables = file.tables(UPSTREAM)
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
    mistakes: Mistakes,
) -> Node | None:
    """One [[upstream]] table as a node; None if it has mistakes (each one recorded)."""

    def error(key: str, value: object, expected: str, *sub: str) -> ConfigError:
        label = ".".join((UPSTREAM, key, *sub))
        return ConfigError(label, value, expected, file.where(UPSTREAM, index, key, *sub))

    before = len(mistakes)
    label = _node_label(table, index)
    url, name = table.get("url"), table.get("name")
    if url is None:
        mistakes.add(
            ConfigError(
                "upstream.url", "", "every [[upstream]] needs a url", file.where(UPSTREAM, index)
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
                existing_file(ca_file)
            except ValueError as exc:
                mistakes.add(error("ca_file", ca_file, str(exc)))
    insecure = table.get("insecure_skip_verify", False)
    if not isinstance(insecure, bool):
        mistakes.add(error("insecure_skip_verify", insecure, "expected true or false"))

    capacity = _own_setting(file, index, table, CAPACITY, capacity_toml, error, mistakes)
    engine = _own_setting(file, index, table, ENGINE, engine_toml, error, mistakes)

    if not isinstance(url, str) or not isinstance(name, str | None):
        return None
    try:
        node = Upstream.parse(url) if name is None else Upstream(name, url)
    except ConfigError as exc:
        if name is None or exc.value != name:
            mistakes.add(error("url", exc.value, exc.expected))
            return None
        mistakes.add(error("name", name, exc.expected))
        # The name is checked first and stops the check there: the URL's
        # own mistake is told too (every mistake at once), with a name that
        # passes in place of the bad one.
        try:
            Upstream("node", url)
        except ConfigError as url_exc:
            mistakes.add(error("url", url_exc.value, url_exc.expected))
        return None
    if node.scheme == "https" and isinstance(ca_file, str) and len(mistakes) == before:
        with mistakes.catch():
            _load_ca_file(ca_file, error)
    if len(mistakes) > before:
        return None
    node = attrs.evolve(
        node, models=models, headers=headers, ca_file=ca_file, insecure_skip_verify=insecure
    )
    return Node(node, Source("file", file.where(UPSTREAM, index)), capacity, engine)


def _load_ca_file(ca_file: str, error: Callable[..., ConfigError]) -> None:
    """Load an https:// node's CA file as serving does, so ``check`` refuses what serving would."""
    try:
        ssl.create_default_context(cafile=ca_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise error("ca_file", ca_file, f"cannot load CA certificates ({exc})") from None


def _own_setting(
    file: ConfigFile,
    index: int,
    table: Mapping[str, Any],
    key: str,
    parse: Callable[[object], Any],
    error: Callable[..., ConfigError],
    mistakes: Mistakes,
) -> tuple[Any, Source] | None:
    """A node's own per-node setting (``capacity``, ``engine``) with its source, if set."""
    if key not in table:
        return None
    raw = table[key]
    try:
        return (parse(raw), Source("file", file.where(UPSTREAM, index, key), raw))
    except ValueError as exc:
        mistakes.add(error(key, raw, expected_of(exc, key)))
        return None


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
    mistakes: Mistakes,
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
            mistakes.add(error("headers", template, "a header value must be a string", header))
            continue
        try:
            value = expand(template, environ, f"{whose} needs it for its {header} header")
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


def resolve_nodes(
    given: Given, sources: dict[str, Source], mistakes: Mistakes
) -> list[Node] | None:
    """The node list from the highest-precedence source that has one; all are checked.

    Returns None when the list in force cannot be built (its mistakes recorded).
    """
    opt = BY_NAME["upstream"]
    candidates: list[tuple[list[Node] | None, Source]] = []

    specs = given.flag_list(opt)
    if specs:
        candidates.append(
            (_nodes_from_specs(specs, opt.flag, "flag", mistakes), Source("flag", opt.flag, specs))
        )
    if opt.env in given.environ:
        text = given.environ[opt.env]
        nodes = _nodes_from_specs(comma_list(text), opt.env, "env", mistakes)
        candidates.append((nodes, Source("env", opt.env, text)))
    file = given.file
    if file is not None and UPSTREAM in file.data:
        nodes = _nodes_from_file(file, given.environ, mistakes)
        candidates.append((nodes, Source("file", file.where(UPSTREAM, 0))))

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


def _nodes_from_specs(
    specs: list[str], where: str, kind: SourceKind, mistakes: Mistakes
) -> list[Node] | None:
    nodes: list[Node] = []
    before = len(mistakes)
    for spec in specs:
        source = Source(kind, where, spec)
        with mistakes.catch():
            nodes.append(Node(_node_from_spec(spec, source), source))
    return None if len(mistakes) > before else nodes
