"""The Trio shell that executes the core's decisions for each workload."""

from __future__ import annotations

from .proxy import Proxy, open_proxy

__all__ = ["Proxy", "open_proxy"]
