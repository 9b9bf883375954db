"""Pure: the client API keys of the settings, and their checks.

``config.py`` builds ``Config.clients`` with these; the checks' errors name
the client, never its key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import attrs

from .errors import ConfigError

__all__ = ["NAME_RE", "SECRET_RE", "ClientKey", "check_clients", "key_tuple"]

# RFC 9110 token characters: a node name goes into a header
# (X-Failover-Node), a client name into logs, events and a metrics label.
NAME_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~:-]{1,128}$")
# What a key or token may hold: it travels in a header value
# (``Authorization: Bearer KEY``), whose surrounding blanks HTTP strips.
SECRET_RE = re.compile(r"[\x21-\x7e]+")


def _check_client_name(instance: ClientKey, attribute: attrs.Attribute[str], value: str) -> None:
    # The name goes into logs, events and a metrics label.
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ConfigError("clients", value, "a client name is 1-128 token characters, no spaces")


def _check_key(instance: ClientKey, attribute: attrs.Attribute[str], value: str) -> None:
    # The errors name the client, never the key.
    if not isinstance(value, str) or not value:
        raise ConfigError("clients", instance.name, f"the key of client {instance.name} is empty")
    if not SECRET_RE.fullmatch(value):
        raise ConfigError(
            "clients",
            instance.name,
            f"the key of client {instance.name} holds blanks, control or non-ASCII characters",
        )


@attrs.frozen
class ClientKey:
    """One client API key. ``name`` is the workload's ``client`` in logs, events and /status.

    ``repr()`` leaves the key out.
    """

    name: str = attrs.field(validator=_check_client_name)
    key: str = attrs.field(validator=_check_key, repr=False)


def key_tuple(value: Iterable[ClientKey]) -> tuple[ClientKey, ...]:
    return tuple(value)


def check_clients(
    instance: object, attribute: attrs.Attribute[Any], value: tuple[ClientKey, ...]
) -> None:
    names: set[str] = set()
    keys: dict[str, str] = {}
    for client in value:
        if not isinstance(client, ClientKey):
            raise ConfigError("clients", type(client).__name__, "expected ClientKey items")
        if client.name in names:
            raise ConfigError("clients", client.name, "client names must be unique")
        if client.key in keys:
            # Which client sent a request must never be ambiguous.
            other = keys[client.key]
            raise ConfigError("clients", client.name, f"the same key as client {other}")
        names.add(client.name)
        keys[client.key] = client.name
