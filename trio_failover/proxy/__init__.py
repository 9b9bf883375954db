"""The Trio shell that executes the core's decisions for each workload.

``Proxy``: the workloads and their attempts, the queue, the node board and
what feeds it (checks, liveness, engine reads), the replicas' shared
state. It may import ``telemetry/``, ``wire/`` and ``core/``.
"""

from __future__ import annotations

from .proxy import Proxy, open_proxy

__all__ = ["Proxy", "open_proxy"]
