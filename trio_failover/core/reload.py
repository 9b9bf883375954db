"""Pure: what a reload of the configuration changes, and what it refuses (docs/configuration.md).

``diff_configs(old, new)`` compares the running ``Config`` with one read
again from the same sources. Its ``ConfigDiff`` says, in words fit for a
log line and a ``reload`` event, what the new one changes (nodes added,
removed and changed field by field, client keys added, removed and
rotated, the TLS files, every other setting) and what it cannot change
while the proxy runs (a listener address: it needs a restart). No value
of a secret (a key, a header value, the admin token) is ever named: only
that it changed.

The shell (``proxy/reload.py``) applies a diff without refusals and keeps
the running one otherwise. Whether the TLS files' contents changed is the
shell's to find out (it reads them); it passes the answer in.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .config import ClientKey, Config, Upstream, redact_url

__all__ = [
    "NodeChange",
    "config_document",
    "config_from_document",
    "diff_configs",
    "hmac_mask",
    "masked",
]

# Settings that a running proxy cannot take: its listeners are bound, its
# logging and traces set up once, its workers started, its shared state
# reached at one address under one prefix (the reason is said in each
# refusal).
NEEDS_RESTART: tuple[str, ...] = (
    "listen",
    "admin_listen",
    "otel_endpoint",
    "log_format",
    "log_level",
    "max_connections",
    "watch_config",
    # The shared state is joined once, with these.
    "state",
    "state_prefix",
    "lease_ttl",
    "state_timeout",
    "workers",
)
# Compared node by node, or client by client, not as settings.
_SETTINGS_SKIPPED = frozenset(
    {"upstreams", "clients", "admin_token", "tls_cert", "tls_key", *NEEDS_RESTART}
)
# Node fields compared as values (models and headers are not part of an
# ``Upstream``'s equality, so they are compared here explicitly).
_NODE_FIELDS = ("url", "capacity", "models", "headers", "ca_file", "insecure_skip_verify")


@attrs.frozen
class NodeChange:
    """One kept node whose definition changed: which fields."""

    name: str
    fields: tuple[str, ...]

    @property
    def reconnects(self) -> bool:
        """Whether its idle connections were made to another address or with other TLS."""
        return bool({"url", "ca_file", "insecure_skip_verify"} & set(self.fields))


@attrs.frozen
class ConfigDiff:
    """What a new configuration changes, and what it refuses."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[NodeChange, ...] = ()
    reordered: bool = False
    clients: tuple[str, ...] = ()
    """One phrase per client change: ``client bob added``, ``client alice: key rotated``."""
    settings: tuple[str, ...] = ()
    """Every other setting that changed, as ``NAME: OLD -> NEW`` (secrets: ``NAME changed``)."""
    tls_files: bool = False
    refused: tuple[str, ...] = ()
    """Why the reload cannot be applied; empty: it can."""

    @property
    def ok(self) -> bool:
        """Whether the new configuration may replace the running one."""
        return not self.refused

    @property
    def nodes_changed(self) -> bool:
        """Whether the node list changed beyond capacities (queued workloads must re-resolve)."""
        if self.added or self.removed or self.reordered:
            return True
        return any(set(change.fields) - {"capacity"} for change in self.changed)

    def changes(self) -> list[str]:
        """The changes, one phrase each, in a stable order (the ``reload`` event's list)."""
        phrases = [f"node {name} added" for name in self.added]
        phrases += [f"node {name} removed" for name in self.removed]
        phrases += [f"node {c.name}: {', '.join(c.fields)} changed" for c in self.changed]
        if self.reordered:
            phrases.append("node order changed")
        phrases += self.clients
        if self.tls_files:
            phrases.append("tls certificate files changed")
        phrases += self.settings
        return phrases


def diff_configs(old: Config, new: Config, *, tls_files_changed: bool = False) -> ConfigDiff:
    """What replacing ``old`` by ``new`` changes; see the module docstring.

    Args:
        old: the running configuration.
        new: the one read again.
        tls_files_changed: whether the contents of the listener's TLS
            certificate or key file differ from those loaded (the shell reads them).
    """
    refused = [
        f"{name}: {_show(getattr(old, name), name)} -> {_show(getattr(new, name), name)}"
        " needs a restart"
        for name in NEEDS_RESTART
        if getattr(old, name) != getattr(new, name)
    ]
    if (old.tls_cert is None) != (new.tls_cert is None):
        refused.append("tls_cert: turning TLS on or off needs a restart")
    if not old.discovery_interval and new.discovery_interval:
        refused.append("discovery_interval: turning discovery on needs a restart")
    old_nodes = {node.name: node for node in old.upstreams}
    new_nodes = {node.name: node for node in new.upstreams}
    kept = [name for name in old_nodes if name in new_nodes]
    changed = []
    for name in kept:
        fields = _node_fields(old_nodes[name], new_nodes[name])
        if fields:
            changed.append(NodeChange(name, fields))
    tls_changed = old.tls_cert is not None and (
        tls_files_changed or (old.tls_cert, old.tls_key) != (new.tls_cert, new.tls_key)
    )
    return ConfigDiff(
        added=tuple(name for name in new_nodes if name not in old_nodes),
        removed=tuple(name for name in old_nodes if name not in new_nodes),
        changed=tuple(changed),
        reordered=kept != [name for name in new_nodes if name in old_nodes],
        clients=tuple(_client_changes(old.clients, new.clients)),
        settings=tuple(_setting_changes(old, new)),
        tls_files=tls_changed,
        refused=tuple(refused),
    )


def _node_fields(old: Upstream, new: Upstream) -> tuple[str, ...]:
    return tuple(field for field in _NODE_FIELDS if getattr(old, field) != getattr(new, field))


def _client_changes(old: tuple[ClientKey, ...], new: tuple[ClientKey, ...]) -> list[str]:
    before = {client.name: client.key for client in old}
    after = {client.name: client.key for client in new}
    phrases = [f"client {name} added" for name in after if name not in before]
    phrases += [f"client {name} removed" for name in before if name not in after]
    phrases += [
        f"client {name}: key rotated"
        for name in after
        if name in before and before[name] != after[name]
    ]
    settings = {client.name: client for client in old}
    phrases += [
        f"client {client.name}: settings changed"
        for client in new
        if client.name in settings and attrs.evolve(settings[client.name], key=client.key) != client
    ]
    return phrases


def _setting_changes(old: Config, new: Config) -> list[str]:
    phrases = []
    for field in attrs.fields(Config):
        name = field.name
        if name in _SETTINGS_SKIPPED:
            continue
        before, after = getattr(old, name), getattr(new, name)
        if before != after:
            phrases.append(f"{name}: {_show(before, name)} -> {_show(after, name)}")
    if old.admin_token != new.admin_token:
        phrases.append("admin_token changed")
    return phrases


def _show(value: object, name: str = "") -> str:
    if name == "state" and isinstance(value, str):
        return redact_url(value)  # a Redis URL's password
    if isinstance(value, frozenset):
        return ",".join(sorted(str(item) for item in value)) or "(none)"
    if isinstance(value, float) and value.is_integer():
        return f"{int(value)}"
    return "(none)" if value is None else str(value)


def hmac_mask(salt: bytes) -> Callable[[str], str]:
    """A mask for ``masked``: HMAC-SHA256 under ``salt`` (fresh per ``GET /config``)."""

    def mask(secret: str) -> str:
        return "hmac-" + hmac.new(salt, secret.encode(), hashlib.sha256).hexdigest()[:32]

    return mask


def masked(config: Config, mask: Callable[[str], str]) -> Config:
    """``config`` with every secret replaced by ``mask(secret)``.

    The secrets: client keys, node header values, the admin token, and the
    ``user:password`` of a node URL and of the shared state's URL. Two
    configurations masked with the same function (an HMAC under one random
    salt, in the shell) compare as the originals do, and neither shows a
    secret.
    """
    nodes = [
        attrs.evolve(
            node,
            url=_mask_url(node.url, mask),
            headers={name: mask(value) for name, value in node.headers.items()},
            models=node.models,
        )
        for node in config.upstreams
    ]
    clients = tuple(
        attrs.evolve(client, key=None if client.key is None else mask(client.key))
        for client in config.clients
    )
    token = None if config.admin_token is None else mask(config.admin_token)
    # A Redis URL's USER:PASS is checked for its shape: the mask keeps it.
    state = _mask_url(config.state, lambda userinfo: f"{mask(userinfo)}:{mask(userinfo)}")
    return attrs.evolve(config, upstreams=nodes, clients=clients, admin_token=token, state=state)


def _mask_url(url: str, mask: Callable[[str], str]) -> str:
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    userinfo, _, host = authority.rpartition("@")
    return f"{scheme}{sep}{mask(userinfo)}@{host}{slash}{path}"


def config_document(config: Config) -> dict[str, Any]:
    """``config`` as JSON values (``config_from_document`` reads it back); mask it first."""
    document: dict[str, Any] = {}
    for field in attrs.fields(Config):
        value = getattr(config, field.name)
        document[field.name] = sorted(value) if isinstance(value, frozenset) else value
    document["upstreams"] = [
        {
            "name": node.name,
            "url": node.url,
            "capacity": node.capacity,
            "models": dict(node.models) if node.models is not None else None,
            "headers": dict(node.headers),
            "ca_file": node.ca_file,
            "insecure_skip_verify": node.insecure_skip_verify,
        }
        for node in config.upstreams
    ]
    document["clients"] = [attrs.asdict(c) for c in config.clients]
    return document


def config_from_document(document: Mapping[str, Any]) -> Config:
    """The ``Config`` that ``config_document`` wrote.

    Raises:
        ConfigError: the document is not a valid configuration.
        KeyError, TypeError: it is not such a document at all.
    """
    known = {field.name for field in attrs.fields(Config)}
    values = {name: value for name, value in document.items() if name in known}
    values["upstreams"] = [
        Upstream(
            node["name"],
            node["url"],
            models=node["models"],
            headers=node["headers"],
            ca_file=node["ca_file"],
            insecure_skip_verify=node["insecure_skip_verify"],
            capacity=node["capacity"],
        )
        for node in document["upstreams"]
    ]
    values["clients"] = [ClientKey(**c) for c in document["clients"]]
    return Config(**values)
