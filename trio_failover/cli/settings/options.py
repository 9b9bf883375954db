"""The option table: every setting's flag, environment variable, TOML key, kind and help.

One row of ``OPTIONS`` per option; the CLI's flags, ``check``'s listing and
the docs' tests are all generated from it.
"""

from __future__ import annotations

from typing import Any

import attrs

from ...core.config import (
    AFFINITY_CHOICES,
    CLIENT_CLOSE_CHOICES,
    FAIR_SHARE_CHOICES,
    LOG_FORMAT_CHOICES,
    LOG_LEVEL_CHOICES,
    Config,
)
from ...core.engines import ENGINE_KINDS
from ...core.slots import BALANCE_MODES
from .kinds import (
    ADMIN,
    BOOL,
    CAPACITIES,
    CLIENTS,
    CODES,
    CONFIG_PATH,
    DURATION,
    ENDPOINT,
    ENGINES,
    FILE,
    HOST_PORT,
    INT,
    NODES,
    SIZE,
    STATE,
    STATUSES,
    TEXT,
    TOKEN,
    Kind,
    choice_kind,
)

__all__ = ["BY_FIELD", "BY_NAME", "ENV_PREFIX", "OPTIONS", "Option", "option"]

ENV_PREFIX = "TRIO_FAILOVER_"


@attrs.frozen
class Option:
    """One setting: its flag, environment variable, TOML key, parser and help.

    ``name`` is the key in the ``flags`` mapping given to ``resolve`` (and the
    CLI's parameter name); ``field`` the ``Config`` attribute it sets (None
    for the options that ``resolve`` reads itself). A ``repeat`` flag may be
    given several times (its ``flags`` value is a list); a ``secret`` one's
    value never shows, in errors or sources. ``fallback_env`` is a variable
    of another program's convention, asked after the config file (a
    setting of this program's own beats one meant for every program).
    """

    name: str
    flag: str
    toml: tuple[str, ...] | None
    kind: Kind
    metavar: str
    help: str
    field: str | None = None
    env: str = ""
    repeat: bool = False
    secret: bool = False
    default_note: str = ""
    fallback_env: str = ""

    @property
    def label(self) -> str:
        """The option's name as written on the command line, without dashes."""
        return self.flag.removeprefix("--")

    @property
    def toml_key(self) -> str:
        """The dotted TOML key (``timeouts.connect``), or "" if the file has none."""
        return ".".join(self.toml) if self.toml else ""

    @property
    def default(self) -> Any:
        """The value used when no source gives one (``Config``'s default)."""
        if self.field is None:
            return None
        return attrs.fields_dict(Config)[self.field].default

    @property
    def default_text(self) -> str:
        """The default as a user would write it."""
        if self.default_note:
            return self.default_note
        return "none" if self.field is None else self.kind.show(self.default)


def _option(
    name: str,
    toml_key: str | None,
    kind: Kind,
    metavar: str,
    help: str,
    *,
    field: str | None = "",
    env: str = "",
    repeat: bool = False,
    secret: bool = False,
    default_note: str = "",
    fallback_env: str = "",
) -> Option:
    return Option(
        name=name,
        flag="--" + name.replace("_", "-"),
        toml=tuple(toml_key.split(".")) if toml_key else None,
        kind=kind,
        metavar=metavar,
        help=help,
        field=name if field == "" else field,
        env=env or ENV_PREFIX + name.upper(),
        repeat=repeat,
        secret=secret,
        default_note=default_note,
        fallback_env=fallback_env,
    )


_CLIENT_CLOSE = choice_kind(CLIENT_CLOSE_CHOICES)
_AFFINITY = choice_kind(AFFINITY_CHOICES)
_BALANCE = choice_kind(BALANCE_MODES)
_LOG_FORMAT = choice_kind(LOG_FORMAT_CHOICES)
_FAIR_SHARE = choice_kind(FAIR_SHARE_CHOICES)
_LOG_LEVEL = choice_kind(LOG_LEVEL_CHOICES, fold_case=True)

# fmt: off
OPTIONS: tuple[Option, ...] = (
    # name, TOML key, kind, metavar, help
    _option("config", None, CONFIG_PATH, "PATH", "TOML config file.", field=None),
    _option("listen", "listen", HOST_PORT, "HOST:PORT", "Client listener; port 0 = any free port."),
    _option("admin_listen", "admin_listen", ADMIN, "HOST:PORT|off", "Admin listener, or off."),
    _option("upstream", "upstream", NODES, "[NAME=]URL",
            "A node, in ranking order; repeat for more. NAME defaults to host:port.",
            field=None, env=ENV_PREFIX + "UPSTREAMS", repeat=True),
    _option("connect_timeout", "timeouts.connect", DURATION, "DUR",
            "TCP (+TLS) connect limit per attempt."),
    _option("response_header_timeout", "timeouts.response_header", DURATION, "DUR",
            "From request written to whole response head read."),
    _option("first_body_timeout", "timeouts.first_body", DURATION, "DUR",
            "From response head to first body byte; 0 = off."),
    _option("stream_idle_timeout", "timeouts.stream_idle", DURATION, "DUR",
            "After commit, longest silence between body bytes; 0 = off."),
    _option("liveness_interval", "liveness_interval", DURATION, "DUR",
            "While a node is silent (no head, no first body byte, a stream that stopped), "
            "ask it GET /health this often; 0 = only at the deadlines."),
    _option("dead_peer_timeout", "timeouts.dead_peer", DURATION, "DUR",
            "TCP keepalive + TCP_USER_TIMEOUT on upstream sockets; 0 = off."),
    _option("client_close", "client_close", _CLIENT_CLOSE, "abort|rst-only|ignore",
            "What a client FIN/RST does to in-flight work."),
    _option("max_attempts", "max_attempts", INT, "N",
            "Attempts per workload; 0 = one per candidate."),
    _option("affinity", "affinity", _AFFINITY, "off|prefix",
            "prefix: a conversation's turns prefer the node that holds its prompt "
            "cache, yielding to load; off: --balance alone."),
    _option("capacity", "capacity", CAPACITIES, "N|auto|NAME=N",
            "Attempts in flight per node, 0 = no limit, auto = the engine's own slots; "
            "NAME=N for one node, N for the rest. Repeat, or comma-separate.",
            field=None, repeat=True, default_note="auto"),
    _option("balance", "balance", _BALANCE, "priority|least-loaded",
            "Order of the ready nodes with a free slot: ranking, or least loaded first."),
    _option("queue_timeout", "timeouts.queue", DURATION, "DUR",
            "Longest wait in the queue for a slot, then 503; 0 = no limit."),
    _option("max_queue", "max_queue", INT, "N",
            "Workloads waiting at once; one more gets 503 at once; 0 = no limit."),
    _option("discovery_interval", "discovery_interval", DURATION, "DUR",
            "How often each node's models and health are checked; 0 = off."),
    _option("unstreamed_timeout", "timeouts.unstreamed", DURATION, "DUR",
            "Replaces the response-header timeout for requests that are not streamed."),
    _option("retry_status", "retry_status", STATUSES, "LIST",
            "Upstream statuses that fail over before commit (comma-separated)."),
    _option("retry_error_codes", "retry_error_codes", CODES, "LIST",
            "4xx JSON error.code values that fail over before commit; empty = none."),
    _option("max_request_body", "max_request_body", SIZE, "SIZE",
            "Larger request bodies get 413."),
    _option("max_request_head", "max_request_head", SIZE, "SIZE",
            "Larger request heads get 431."),
    _option("client_header_timeout", "timeouts.client_header", DURATION, "DUR",
            "A client's request head must arrive within this (408)."),
    _option("keepalive_timeout", "timeouts.keepalive", DURATION, "DUR",
            "Idle client keep-alive connections are closed after this."),
    _option("max_connections", "max_connections", INT, "N",
            "Concurrent client connections; more wait in the backlog."),
    _option("shutdown_timeout", "timeouts.shutdown", DURATION, "DUR",
            "On SIGTERM/SIGINT, in-flight workloads get this long to finish."),
    _option("pool_idle_timeout", "timeouts.pool_idle", DURATION, "DUR",
            "Idle upstream connections are closed after this."),
    # -- engines (docs/engines.md) --
    _option("engine", "engine", ENGINES, "NAME=KIND",
            "A node's engine: " + ", ".join(ENGINE_KINDS) + "; KIND alone for the rest. Repeat.",
            field=None, env=ENV_PREFIX + "ENGINES", repeat=True, default_note="auto"),
    _option("load_interval", "load_interval", DURATION, "DUR",
            "How often the engines' own load and loaded models are read; 0 = with each check."),
    _option("cold_start_timeout", "timeouts.cold_start", DURATION, "DUR",
            "Head deadline of an attempt at a node that must first load the model."),
    _option("api_key", "client", CLIENTS, "[NAME=]KEY",
            "A client key; repeat for more. Any key turns key checks on. NAME defaults to key-N.",
            field=None, env=ENV_PREFIX + "API_KEYS", repeat=True, secret=True),
    # Sharing the fleet among clients (docs/sharing.md).
    _option("client_header", "client_header", TEXT, "NAME",
            "Without client keys, this request header names the workload's client."),
    _option("fair_share", "fair_share", _FAIR_SHARE, "on|off",
            "on: a freed slot goes to the waiting client that used the fleet least; "
            "off: first come, first served."),
    _option("admin_token", None, TOKEN, "TOKEN",
            "Required on every admin route but /healthz.", secret=True),
    _option("tls_cert", "tls_cert", FILE, "PATH", "Certificate (PEM) for TLS on the listener."),
    _option("tls_key", "tls_key", FILE, "PATH", "Private key (PEM) of --tls-cert."),
    _option("log_format", "log_format", _LOG_FORMAT, "text|json", "Log line format."),
    _option("log_level", "log_level", _LOG_LEVEL, "LEVEL",
            "One of " + ", ".join(LOG_LEVEL_CHOICES) + "."),
    _option("otel_endpoint", "otel_endpoint", ENDPOINT, "URL|off",
            "OpenTelemetry collector (OTLP/HTTP) for traces; needs the otel extra. "
            "Also read from OTEL_EXPORTER_OTLP_ENDPOINT.",
            fallback_env="OTEL_EXPORTER_OTLP_ENDPOINT"),
    _option("watch_config", "watch_config", BOOL, "",
            "Reload the config file when it changes, as on SIGHUP (polled each second)."),
    # The replicas' shared state (docs/replicas.md).
    _option("state", "state", STATE, "memory|URL",
            "Shared state of several replicas: memory (this process alone) or "
            "redis://[USER:PASS@]HOST:PORT[/DB] (rediss:// for TLS); needs the redis extra."),
    _option("state_prefix", "state_prefix", TEXT, "TEXT",
            "Prefix of every key and channel in the shared state (several fleets, one Redis)."),
    _option("lease_ttl", "lease_ttl", DURATION, "DUR",
            "A slot's lease in the shared state, renewed while its attempt runs."),
    _option("state_timeout", "timeouts.state", DURATION, "DUR",
            "Longest wait for the shared state on a request's path."),
    _option("workers", "workers", INT, "N",
            "Processes sharing the listeners (SO_REUSEPORT); more than 1 needs --state redis://."),
)
# fmt: on

BY_NAME: dict[str, Option] = {opt.name: opt for opt in OPTIONS}
BY_FIELD: dict[str, Option] = {opt.field: opt for opt in OPTIONS if opt.field}


def option(name: str) -> Option:
    """The row of ``OPTIONS`` called ``name`` (``"first_body_timeout"``).

    Raises:
        KeyError: there is no such option.
    """
    return BY_NAME[name]
