"""Clients: from ``--api-key`` specs or ``[[client]]`` tables; errors never quote a key.

The list is taken whole from the first source that has one, like the nodes.
A table without a key checks nothing: it carries the share and limits of
the client that ``--client-header`` names (docs/sharing.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...core.config import ClientKey
from ...core.errors import ConfigError
from .expand import expand
from .given import Given
from .kinds import SECRET, comma_list
from .options import BY_NAME
from .sources import DEFAULT, Mistakes, Source, SourceKind
from .toml_file import CLIENT, ConfigFile

__all__ = ["resolve_clients"]

# A [[client]] table's settings besides its name and key (``ClientKey``'s fields).
_CLIENT_SETTINGS = ("weight", "priority", "max_in_flight", "rpm", "tpm")
_CLIENT_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z:-]{1,128}")  # as config.ClientKey takes


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
    specs: list[str], where: str, kind: SourceKind, mistakes: Mistakes
) -> list[tuple[ClientKey, Source]] | None:
    clients: list[tuple[ClientKey, Source]] = []
    before = len(mistakes)
    for position, spec in enumerate(specs, start=1):
        with mistakes.catch():
            clients.append(_client_from_spec(spec, position, Source(kind, where)))
    return None if len(mistakes) > before else clients


def _clients_from_file(
    file: ConfigFile, environ: Mapping[str, str], mistakes: Mistakes
) -> list[tuple[ClientKey, Source]] | None:
    """The file's [[client]] tables; None if any is wrong (each mistake recorded)."""
    tables = file.tables(CLIENT)
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
            "client.name", name, "expected a string", file.where(CLIENT, index, "name")
        )
    label = name or f"key-{index + 1}"
    where = file.where(CLIENT, index, "key")
    template = table.get("key")
    if template is None and name is None:
        # Named by nothing: neither a key nor a header could ever pick it.
        raise ConfigError(
            "client.name", label, "a client without a key needs a name", file.where(CLIENT, index)
        )
    if template is not None and not isinstance(template, str):
        raise ConfigError("client.key", label, f"the key of client {label} must be a string", where)
    key = None
    if template is not None:
        try:
            key = expand(template, environ, f"client {label} needs it for its key")
        except ConfigError as exc:
            raise ConfigError("client.key", exc.value, exc.expected, where) from None
    settings = {field: table[field] for field in _CLIENT_SETTINGS if field in table}
    try:
        client = ClientKey(label, key, **settings)
    except ConfigError as exc:
        field = exc.option.removeprefix("client.")
        if field in settings:  # a share or a limit: its own line, its own value
            raise ConfigError(
                exc.option, exc.value, exc.expected, file.where(CLIENT, index, field)
            ) from None
        key_name = "client.name" if exc.expected.startswith("a client name") else "client.key"
        raise ConfigError(key_name, label, exc.expected, where) from None
    return client, Source("file", file.where(CLIENT, index), label)


def resolve_clients(
    given: Given,
    sources: dict[str, Source],
    mistakes: Mistakes,
) -> tuple[ClientKey, ...]:
    """The client keys from the first source that has any (the list is never merged)."""
    opt = BY_NAME["api_key"]
    candidates: list[tuple[list[tuple[ClientKey, Source]] | None, Source]] = []
    specs = given.flag_list(opt)
    if specs:
        clients = _clients_from_specs(specs, opt.flag, "flag", mistakes)
        candidates.append((clients, Source("flag", opt.flag, SECRET)))
    if opt.env in given.environ:
        items = comma_list(given.environ[opt.env])
        if not items:
            # An empty list would turn the key checks off without a word.
            mistakes.add(
                ConfigError("api-key", "", "no key in it; unset the variable for no keys", opt.env)
            )
        clients = _clients_from_specs(items, opt.env, "env", mistakes)
        candidates.append((clients, Source("env", opt.env, SECRET)))
    file = given.file
    if file is not None and CLIENT in file.data:
        clients = _clients_from_file(file, given.environ, mistakes)
        candidates.append((clients, Source("file", file.where(CLIENT, 0), SECRET)))
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
        elif client.key is not None and client.key in keys:
            mistakes.add(
                ConfigError(
                    label.replace("name", "key"),
                    client.name,
                    f"client {client.name} has the same key as client {keys[client.key]}",
                    source.where,
                )
            )
        names.setdefault(client.name, source)
        if client.key is not None:
            keys.setdefault(client.key, client.name)
        sources[f"client:{client.name}"] = source
    return tuple(client for client, _ in chosen)
