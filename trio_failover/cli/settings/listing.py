"""``check``'s listing: one row per resolved setting with its source, secrets masked."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ...core.config import ClientKey, Config, Upstream, redact_url
from .kinds import SECRET, show_path
from .options import OPTIONS
from .sources import DEFAULT, Source

__all__ = ["describe"]


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


def _per_node(
    name: str, config: Config, sources: Mapping[str, Source]
) -> list[tuple[str, str, str]]:
    """The rows of a per-node option: ``capacity NODE`` (``auto`` or N), ``engine NODE``."""
    rows: list[tuple[str, str, str]] = []
    for node in config.upstreams:
        value = getattr(node, name)
        source = sources.get(f"{name}:{node.name}", DEFAULT)
        rows.append((f"{name} {node.name}", "auto" if value is None else str(value), str(source)))
    return rows


def describe(config: Config, sources: Mapping[str, Source]) -> list[tuple[str, str, str]]:
    """Rows ``(option, value, source)`` of the resolved settings, secrets masked.

    One row per option, in ``OPTIONS`` order; one row per node in place of
    the ``upstream``, ``capacity`` and ``engine`` options (a capacity
    ``auto`` is the engine's own, read once the proxy runs), one per client key (its
    value ``***``) in place of ``api-key``.
    """
    rows: list[tuple[str, str, str]] = []
    for opt in OPTIONS:
        if opt.name == "config":
            source = sources.get("config", DEFAULT)
            path = None if source.raw is None else str(source.raw)
            rows.append((opt.label, show_path(path), str(source)))
        elif opt.name == "upstream":
            for node in config.upstreams:
                source = sources.get(f"upstream:{node.name}", DEFAULT)
                rows.append((f"upstream {node.name}", _show_node(node), str(source)))
        elif opt.name in ("capacity", "engine"):
            rows += _per_node(opt.name, config, sources)
        elif opt.name == "api_key":
            for client in config.clients:
                source = sources.get(f"client:{client.name}", DEFAULT)
                label = "api-key" if client.key is not None else "client"
                shown = " ".join([SECRET] * (client.key is not None) + _client_settings(client))
                rows.append((f"{label} {client.name}", shown or "(defaults)", str(source)))
            if not config.clients:
                rows.append((opt.label, "none", str(sources.get("clients", DEFAULT))))
        elif opt.field is not None:
            value = opt.kind.show(getattr(config, opt.field))
            rows.append((opt.label, value, str(sources.get(opt.field, DEFAULT))))
    return rows


def _client_settings(client: ClientKey) -> list[str]:
    """A client's share and limits that differ from the defaults, as ``key=value``."""
    shown = []
    defaults = attrs.fields_dict(ClientKey)
    for field in ("weight", "priority", "max_in_flight", "rpm", "tpm"):
        value = getattr(client, field)
        if value != defaults[field].default:
            shown.append(f"{field}={value:g}" if field == "weight" else f"{field}={value}")
    return shown
