"""The Trio shell that executes the core's decisions for each workload."""

from __future__ import annotations

from .proxy import Proxy

__all__ = ["Proxy"]
