"""trio-failover: a failover reverse proxy for self-hosted LLM inference fleets.

The library API (see docs/embedding.md):

- ``Config``, ``Upstream`` and ``ClientKey``: the settings, frozen and validated.
- ``serve(config, ...)``: run the listeners in your nursery
  (``await nursery.start(serve, config)`` gives the ``BoundAddresses``).
- ``open_proxy(config, connector=...)`` (``async with``): the proxy itself,
  its own tasks running for the block, serving any ``trio.abc.Stream``;
  ``Proxy(config, connector=...)`` the same, entered with ``async with`` or
  run with ``await nursery.start(proxy.run)``; ``Connector`` is what it opens node connections with
  (``TCPConnector`` by default, ``trio_failover.testing`` has an in-memory one).
- ``proxy.events.subscribe()``: workload and node events (``EventBus``,
  ``Subscription``).
- The exception tree under ``FailoverError``; ``AttemptRecord`` and
  ``Outcome`` describe one attempt.

The names that need Trio are imported on first use, so ``import
trio_failover`` (and with it ``trio-failover check``) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.config import ClientKey, Config, Upstream
from .core.errors import (
    ClientError,
    ConfigError,
    ConnectFailed,
    ConnectTimeout,
    DeadPeer,
    FailoverError,
    FirstBodyTimeout,
    HeaderTimeout,
    RetryableResponse,
    TLSError,
    UpstreamClosedEarly,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamReset,
)
from .core.outcome import AttemptRecord, Outcome
from .core.version import __version__

if TYPE_CHECKING:
    from .proxy import Proxy, open_proxy
    from .service.server import BoundAddresses, run_server, serve
    from .telemetry.events import EventBus, Subscription
    from .wire.upstream import Connector, TCPConnector

# Public name -> the module that defines it, imported when first asked for.
_LAZY = {
    "BoundAddresses": "service.server",
    "Connector": "wire.upstream",
    "EventBus": "telemetry.events",
    "Proxy": "proxy",
    "Subscription": "telemetry.events",
    "TCPConnector": "wire.upstream",
    "open_proxy": "proxy",
    "run_server": "service.server",
    "serve": "service.server",
}

__all__ = [
    "AttemptRecord",
    "BoundAddresses",
    "ClientError",
    "ClientKey",
    "Config",
    "ConfigError",
    "ConnectFailed",
    "ConnectTimeout",
    "Connector",
    "DeadPeer",
    "EventBus",
    "FailoverError",
    "FirstBodyTimeout",
    "HeaderTimeout",
    "Outcome",
    "Proxy",
    "RetryableResponse",
    "Subscription",
    "TCPConnector",
    "TLSError",
    "Upstream",
    "UpstreamClosedEarly",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamReset",
    "__version__",
    "open_proxy",
    "run_server",
    "serve",
]


if not TYPE_CHECKING:
    # Hidden from type checkers: they see the imports above instead, and a
    # module ``__getattr__`` would make every misspelt name an ``Any``.

    def __getattr__(name: str) -> Any:
        # PEP 562: called only for names not found in the module's globals.
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
