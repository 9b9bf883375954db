"""Configuration: frozen attrs classes, validated on construction.

A ``Config`` never changes while the proxy serves; derive a changed copy with
``attrs.evolve``. Durations are float seconds (``0`` disables the optional
deadlines), sizes are bytes. Turning strings from flags, environment or TOML
into these values is the job of ``cli/settings/``; this module only says what
a valid configuration is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs

from .client_key import NAME_RE, SECRET_RE, check_clients, key_tuple
from .client_key import ClientKey as ClientKey  # re-exported: part of the settings
from .engines import check_engine_kind
from .errors import ConfigError
from .errors import redact_url as redact_url  # re-exported: where callers found it
from .names import WILDCARD, accepts, node_model_name
from .redis_url import StateSettings
from .slots import BALANCE_MODES, Balance

ClientClose = Literal["abort", "rst-only", "ignore"]
Affinity = Literal["off", "prefix"]
LogFormat = Literal["text", "json"]
FairShare = Literal["on", "off"]

CLIENT_CLOSE_CHOICES: tuple[str, ...] = ("abort", "rst-only", "ignore")
AFFINITY_CHOICES: tuple[str, ...] = ("off", "prefix")
LOG_FORMAT_CHOICES: tuple[str, ...] = ("text", "json")
FAIR_SHARE_CHOICES: tuple[str, ...] = ("on", "off")
# A request header's name (RFC 9110 token): what --client-header may name.
_HEADER_FIELD_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
LOG_LEVEL_CHOICES: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")

WILDCARD_MODEL = WILDCARD
# ASCII digits only: str.isdigit() also takes "²", which int() refuses.
_PORT_RE = re.compile(r"[0-9]+")
HOST_PORT_EXPECTED = "expected HOST:PORT with a port from 0 to 65535"


def split_host_port(value: str, option: str = "listen") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:8080`` for IPv6) into its parts.

    Raises:
        ConfigError: the value is not ``HOST:PORT`` with a port in 0..65535.
    """
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not _PORT_RE.fullmatch(port_text):
        raise ConfigError(option, value, HOST_PORT_EXPECTED)
    port = int(port_text)
    if port > 65535:
        raise ConfigError(
            option, value, f"port {port} is out of range: 1-65535, or 0 for any free port"
        )
    return host, port


def url_port(url: str) -> int | None:
    """The port written in an http(s) URL, or None when it names none.

    ``urlsplit`` would say "could not be cast to integer" for a port that is
    merely too big, and take ``:0`` for "no port"; a node's port is 1-65535.

    Raises:
        ValueError: the port is not a number or is out of range; the message says which.
    """
    authority = urlsplit(url).netloc.rpartition("@")[2]
    if authority.startswith("["):
        after = authority.partition("]")[2]
        port_text = after[1:] if after.startswith(":") else ""
    else:
        port_text = authority.rpartition(":")[2] if ":" in authority else ""
    if not port_text:
        return None
    if not _PORT_RE.fullmatch(port_text):
        raise ValueError(f"the URL's port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range: a node's port is 1-65535")
    return port


def _models_converter(value: Any) -> Mapping[str, str] | None:
    # A list means "serves exactly these names, under the same names"; a table
    # maps the client's name to the node's own name for that model.
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, str):
        return {value: value}
    return {str(name): str(name) for name in value}


def _headers_converter(value: Any) -> Mapping[str, str]:
    # Surrounding blanks (a value pasted from a .env file) are not part of a
    # field value (RFC 9110 section 5.5); h11 would refuse to send them.
    if value is None:
        return {}
    return {str(k).strip(): str(v).strip(" \t") for k, v in dict(value).items()}


_FIELD_VALUE_RE = re.compile(r"^[\t\x20-\x7e\x80-\xff]*$")


def _check_headers(
    instance: Upstream, attribute: attrs.Attribute[Any], value: Mapping[str, str]
) -> None:
    # The error names the header, never its value: values are credentials.
    for name, text in value.items():
        if not NAME_RE.match(name) or ":" in name:
            raise ConfigError("headers", name, "a header name is a token (letters, digits, -)")
        if not _FIELD_VALUE_RE.match(text):
            raise ConfigError(
                "headers", f"{name}: ***", "a header value holds no control characters"
            )


def _hide_values(value: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{name!r}: '***'" for name in value) + "}"


def _check_name(instance: Upstream, attribute: attrs.Attribute[str], value: str) -> None:
    if not NAME_RE.match(value):
        raise ConfigError("upstream", value, "a node name is 1-128 token characters, no spaces")


def _check_capacity(instance: Upstream, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise ConfigError("capacity", value, "a whole number of attempts, 0 (no limit), or auto")


def _check_url(instance: Upstream, attribute: attrs.Attribute[str], value: str) -> None:
    # The host goes into the Host header and the path before every request
    # target as they are, and the proxy sends its own headers to nodes
    # without h11's checks (upstream.OutgoingRequest): refuse here what a URL
    # must percent-encode, blanks and control characters among it.
    if not value.isascii() or not value.isprintable() or " " in value:
        raise ConfigError(
            "upstream", value, "a node URL holds no blanks or non-ASCII (percent-encode them)"
        )
    try:
        parts = urlsplit(value)
        hostname = parts.hostname  # raises ValueError on a broken IPv6 literal
    except ValueError as exc:
        raise ConfigError("upstream", value, f"not a valid URL ({exc})") from None
    try:
        url_port(value)
    except ValueError as exc:
        raise ConfigError("upstream", value, str(exc)) from None
    if parts.scheme not in ("http", "https") or not hostname:
        raise ConfigError("upstream", value, "expected an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ConfigError("upstream", value, "a node URL takes no query or fragment")


@attrs.frozen
class Upstream:
    """One node: a name and a base URL, plus optional model routing and headers.

    ``Upstream("gpu-a", "http://10.0.0.5:8000")``. A URL with a path prefix
    (``http://host/ollama``) has it prepended to every request path.
    """

    name: str = attrs.field(validator=_check_name)
    url: str = attrs.field(validator=_check_url, repr=lambda url: repr(redact_url(url)))
    models: Mapping[str, str] | None = attrs.field(
        default=None, kw_only=True, converter=_models_converter, eq=False
    )
    headers: Mapping[str, str] = attrs.field(
        factory=dict,
        kw_only=True,
        converter=_headers_converter,
        validator=_check_headers,
        eq=False,
        repr=_hide_values,
    )
    ca_file: str | None = attrs.field(default=None, kw_only=True)
    insecure_skip_verify: bool = attrs.field(default=False, kw_only=True)
    capacity: int | None = attrs.field(default=None, kw_only=True, validator=_check_capacity)
    """Most attempts in flight here; 0 = no limit, None = ``auto`` (the engine's own)."""
    # -- engines (docs/engines.md) --
    engine: str = attrs.field(default="auto", kw_only=True, validator=check_engine_kind)
    """The node's engine kind (``engines.ENGINE_KINDS``); ``auto`` = detected."""

    # Parts of the URL, computed once: requests read them on every attempt.
    scheme: str = attrs.field(init=False, eq=False, repr=False)
    """``http`` or ``https``."""
    host: str = attrs.field(init=False, eq=False, repr=False)
    """The host name or address, without IPv6 brackets."""
    port: int = attrs.field(init=False, eq=False, repr=False)
    """The port, defaulting to 80 or 443 by scheme."""
    base_path: str = attrs.field(init=False, eq=False, repr=False)
    """The URL's path without its trailing slash ("" for none)."""
    host_header: str = attrs.field(init=False, eq=False, repr=False)
    """The ``Host`` header value for requests to this node."""

    def __attrs_post_init__(self) -> None:
        parts = urlsplit(self.url)
        set_part = object.__setattr__  # the class is frozen
        set_part(self, "scheme", parts.scheme)
        set_part(self, "host", parts.hostname or "")
        set_part(self, "port", parts.port or (443 if parts.scheme == "https" else 80))
        set_part(self, "base_path", parts.path.rstrip("/"))
        set_part(self, "host_header", parts.netloc.rpartition("@")[2])

    def serves(self, model: str | None) -> bool:
        """Whether this node's configuration takes a request for ``model`` (None: no model named).

        Names compare as Ollama resolves them (``names.accepts``).
        """
        return model is None or accepts(model, self.models)

    def model_name_for(self, model: str) -> str:
        """The name this node is sent for the client's ``model`` (``names.node_model_name``)."""
        return node_model_name(model, self.models)

    @classmethod
    def parse(cls, spec: str) -> Upstream:
        """Build a node from the ``[NAME=]URL`` form of ``--upstream``.

        The name defaults to ``host:port`` of the URL.
        """
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            url, name = spec, ""
        url = url.strip()
        if not name:
            try:
                parts = urlsplit(url)
                hostname = parts.hostname
                port = url_port(url) or (443 if parts.scheme == "https" else 80)
            except ValueError as exc:
                raise ConfigError("upstream", spec, str(exc)) from None
            if parts.scheme not in ("http", "https") or not hostname:
                raise ConfigError("upstream", spec, "expected [NAME=]http://HOST:PORT")
            name = f"{hostname}:{port}"
        return cls(name.strip(), url)


def _non_negative(instance: Config, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ConfigError(attribute.name, value, "must not be negative")


def _positive(instance: Config, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ConfigError(attribute.name, value, "must be greater than zero")


def _choice(choices: tuple[str, ...]) -> Any:
    def check(instance: Config, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in choices:
            raise ConfigError(attribute.name, value, "one of " + ", ".join(choices))

    return check


def _check_upstreams(
    instance: Config, attribute: attrs.Attribute[tuple[Upstream, ...]], value: tuple[Upstream, ...]
) -> None:
    if not value:
        raise ConfigError("upstream", "", "at least one upstream node is required")
    seen: set[str] = set()
    for node in value:
        if node.name in seen:
            raise ConfigError("upstream", node.name, "node names must be unique")
        seen.add(node.name)


def _check_listen(instance: Config, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        split_host_port(value, attribute.name)


def _nodes(value: Iterable[Upstream]) -> tuple[Upstream, ...]:
    return tuple(value)


def _statuses(value: Iterable[int]) -> frozenset[int]:
    return frozenset(int(v) for v in value)


def _check_statuses(
    instance: Config, attribute: attrs.Attribute[frozenset[int]], value: frozenset[int]
) -> None:
    # Only an error answer may be retried: a 2xx or 3xx is the node's real answer.
    for status in value:
        if not 400 <= status <= 599:
            raise ConfigError(attribute.name, status, "retryable statuses are 400-599")


def _check_token(instance: Config, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not SECRET_RE.fullmatch(value):
        # Never the value itself: it is a secret.
        raise ConfigError(
            attribute.name,
            "***",
            "a token is 1 or more visible ASCII characters (no blanks, no control characters)",
        )


def _check_header_field(
    instance: Config, attribute: attrs.Attribute[Any], value: str | None
) -> None:
    if value is not None and (not isinstance(value, str) or not _HEADER_FIELD_RE.fullmatch(value)):
        raise ConfigError("client-header", value, "a header name: 1-128 token characters")


def _show_token(value: str | None) -> str:
    return "None" if value is None else "'***'"


def _check_endpoint(
    instance: Config, attribute: attrs.Attribute[str | None], value: object
) -> None:
    try:
        parts = urlsplit(value) if isinstance(value, str) else None
        valid = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # a broken IPv6 literal
        valid = False
    if value is not None and not valid:
        raise ConfigError(attribute.name, value, "expected an http:// or https:// URL with a host")
    if isinstance(value, str):
        try:
            url_port(value)
        except ValueError:  # urlsplit reads "http://h:99999" and fails only when asked its port
            raise ConfigError(
                attribute.name, value, "expected a URL whose port, if any, is from 1 to 65535"
            ) from None


MiB = 1024 * 1024


@attrs.frozen(kw_only=True)
class Config(StateSettings):
    """Everything the proxy needs to serve; docs/configuration.md (and ``StateSettings``)."""

    upstreams: tuple[Upstream, ...] = attrs.field(converter=_nodes, validator=_check_upstreams)
    listen: str = attrs.field(default="127.0.0.1:8080", validator=_check_listen)
    admin_listen: str | None = attrs.field(default="127.0.0.1:8081", validator=_check_listen)

    connect_timeout: float = attrs.field(default=10.0, validator=_positive)
    response_header_timeout: float = attrs.field(default=120.0, validator=_positive)
    first_body_timeout: float = attrs.field(default=0.0, validator=_non_negative)
    stream_idle_timeout: float = attrs.field(default=300.0, validator=_non_negative)
    dead_peer_timeout: float = attrs.field(default=30.0, validator=_non_negative)
    liveness_interval: float = attrs.field(default=10.0, validator=_non_negative)
    """Seconds of a node's silence between two liveness checks; 0 = only at the deadlines."""

    client_close: ClientClose = attrs.field(
        default="abort", validator=_choice(CLIENT_CLOSE_CHOICES)
    )
    max_attempts: int = attrs.field(default=0, validator=_non_negative)
    affinity: Affinity = attrs.field(default="prefix", validator=_choice(AFFINITY_CHOICES))
    balance: Balance = attrs.field(default="priority", validator=_choice(BALANCE_MODES))
    queue_timeout: float = attrs.field(default=120.0, validator=_non_negative)
    """Longest wait in the queue for a slot; 0 = no limit."""
    max_queue: int = attrs.field(default=1000, validator=_non_negative)
    """Workloads waiting at once; 0 = no limit."""
    discovery_interval: float = attrs.field(default=30.0, validator=_non_negative)
    """Seconds between inventory and health checks of each node; 0 = off."""
    unstreamed_timeout: float = attrs.field(default=600.0, validator=_positive)
    """Replaces response_header_timeout for requests that are not streamed."""
    retry_status: frozenset[int] = attrs.field(
        default=frozenset({429, 500, 502, 503, 504}), converter=_statuses, validator=_check_statuses
    )
    retry_error_codes: frozenset[str] = attrs.field(
        default=frozenset({"context_length_exceeded"}), converter=frozenset
    )

    max_request_body: int = attrs.field(default=32 * MiB, validator=_non_negative)
    max_request_head: int = attrs.field(default=64 * 1024, validator=_positive)
    client_header_timeout: float = attrs.field(default=30.0, validator=_positive)
    keepalive_timeout: float = attrs.field(default=75.0, validator=_non_negative)
    max_connections: int = attrs.field(default=1024, validator=_positive)
    shutdown_timeout: float = attrs.field(default=30.0, validator=_non_negative)

    pool_idle_timeout: float = attrs.field(default=4.0, validator=_non_negative)
    pool_max_idle: int = attrs.field(default=256, validator=_non_negative)

    clients: tuple[ClientKey, ...] = attrs.field(
        default=(), converter=key_tuple, validator=check_clients
    )
    """The clients: keys (with none, nothing is checked), shares and limits."""
    client_header: str | None = attrs.field(default=None, validator=_check_header_field)
    """Without keys, the request header that names the workload's client; None = none."""
    fair_share: FairShare = attrs.field(default="on", validator=_choice(FAIR_SHARE_CHOICES))
    """``on``: a freed slot goes to the client that used the fleet least; ``off``: FIFO."""
    admin_token: str | None = attrs.field(default=None, validator=_check_token, repr=_show_token)
    """Required on every admin route but /healthz; None = open."""

    tls_cert: str | None = None
    tls_key: str | None = None
    log_format: LogFormat = attrs.field(default="text", validator=_choice(LOG_FORMAT_CHOICES))
    log_level: str = attrs.field(default="info", validator=_choice(LOG_LEVEL_CHOICES))
    watch_config: bool = False
    """Reload the config file when it changes, as on ``SIGHUP``; the CLI's."""
    otel_endpoint: str | None = attrs.field(
        default=None, validator=_check_endpoint, repr=lambda url: repr(url and redact_url(url))
    )
    """The OTLP/HTTP collector that gets the traces; None = no traces."""

    @property
    def keyed_clients(self) -> tuple[ClientKey, ...]:
        """The clients with a key: with any, every request must present one."""
        return tuple(client for client in self.clients if client.key is not None)

    # -- engines (docs/engines.md) --
    load_interval: float = attrs.field(default=2.0, validator=_non_negative)
    """Seconds between reads of the engines' signals; 0 = only with each check."""
    cold_start_timeout: float = attrs.field(default=300.0, validator=_non_negative)
    """The head deadline of an attempt at a node known not to hold the model loaded."""


class LiveConfig:
    """The running configuration of one proxy: the one reference every part reads at use.

    A part keeps this holder, never a ``Config`` of its own, and reads
    ``live.config`` when it needs a setting, so a reload that replaces
    ``config`` here has changed it for every part at once: there is no list
    of copies to keep up to date. (``tests/test_live_config.py`` walks a
    running proxy's parts and fails on any ``Config`` held elsewhere.)
    """

    __slots__ = ("config",)

    def __init__(self, config: Config) -> None:
        self.config = config


def live_config(config: Config | LiveConfig) -> LiveConfig:
    """The holder a part reads: the proxy's own, or a new one for a part made alone (tests)."""
    return config if isinstance(config, LiveConfig) else LiveConfig(config)


def take_over(live: LiveConfig, config: Config) -> None:
    """A part's ``reconcile``: a proxy's holder has the new config already; a lone part takes it."""
    if live.config is not config:
        live.config = config
