"""Pure: the clients of the settings (their keys, shares and limits), and their checks.

``config.py`` builds ``Config.clients`` with these; the checks' errors name
the client, never its key. A client with a key is checked (docs/security.md);
one without a key only carries the settings of the client that
``--client-header`` names (docs/sharing.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import attrs

from .errors import ConfigError
from .sharing import PRIORITIES

__all__ = ["NAME_RE", "SECRET_RE", "ClientKey", "check_clients", "key_tuple"]

# RFC 9110 token characters: a node name goes into a header
# (X-Failover-Node), a client name into logs, events and a metrics label.
NAME_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~:-]{1,128}$")
# A client without a key is named by a header, whose names may hold "@"
# (an e-mail address, as Open WebUI forwards it).
HEADER_NAME_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
# What a key or token may hold: it travels in a header value
# (``Authorization: Bearer KEY``), whose surrounding blanks HTTP strips.
SECRET_RE = re.compile(r"[\x21-\x7e]+")


def _check_client_name(instance: ClientKey, attribute: attrs.Attribute[str], value: str) -> None:
    # The name goes into logs, events and a metrics label.
    if not isinstance(value, str) or not (NAME_RE.match(value) or HEADER_NAME_RE.match(value)):
        raise ConfigError("clients", value, "a client name is 1-128 token characters, no spaces")


def _check_key(instance: ClientKey, attribute: attrs.Attribute[str | None], value: object) -> None:
    # The errors name the client, never the key.
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError("clients", instance.name, f"the key of client {instance.name} is empty")
    if not SECRET_RE.fullmatch(value):
        raise ConfigError(
            "clients",
            instance.name,
            f"the key of client {instance.name} holds blanks, control or non-ASCII characters",
        )


def _check_weight(instance: ClientKey, attribute: attrs.Attribute[float], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value < float("inf")
    ):
        raise ConfigError("client.weight", value, "a weight is a positive number")


def _check_count(instance: ClientKey, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"client.{attribute.name}", value, "expected an integer >= 0 (0 = no limit)"
        )


def _check_priority(instance: ClientKey, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in PRIORITIES:
        raise ConfigError("client.priority", value, "one of " + ", ".join(PRIORITIES))


@attrs.frozen
class ClientKey:
    """One client: its key (None: named by ``--client-header``), its share and limits.

    ``name`` is the workload's ``client`` in logs, events and /status.
    ``repr()`` leaves the key out.
    """

    name: str = attrs.field(validator=_check_client_name)
    key: str | None = attrs.field(default=None, validator=_check_key, repr=False)
    weight: float = attrs.field(default=1.0, validator=_check_weight)
    """Its share of a full fleet, relative to the other clients' weights."""
    priority: str = attrs.field(default="normal", validator=_check_priority)
    """``high``, ``normal`` or ``low``: who a freed slot goes to first."""
    max_in_flight: int = attrs.field(default=0, validator=_check_count)
    """Its attempts running at once, at most; 0 = no limit."""
    rpm: int = attrs.field(default=0, validator=_check_count)
    """Requests in the last minute, at most; 0 = no limit."""
    tpm: int = attrs.field(default=0, validator=_check_count)
    """Tokens (prompt + completion) in the last minute, at most; 0 = no limit."""


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
        if client.key is not None and client.key in keys:
            # Which client sent a request must never be ambiguous.
            other = keys[client.key]
            raise ConfigError("clients", client.name, f"the same key as client {other}")
        names.add(client.name)
        if client.key is not None:
            keys[client.key] = client.name
