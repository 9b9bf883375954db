"""The Trio shell that executes the core's decisions for each workload.

``proxy.py``'s ``Proxy`` ties the parts together (and checks the client
keys); ``reload.py`` carries a new configuration out. Below them, in
folders by job: ``request/`` (a workload's life: its nursery, attempts,
relay, answers), ``fleet/`` (the replicas, over Redis) and ``nodes/``
(the node board, what feeds it, the slot queue, the silence watch, the
lists, ``/status``); below all of them ``report.py`` (the telemetry every
part writes to) and ``records.py`` (the ``Workload`` record). Imports go
down that order (import-linter's contract for this folder). It may import
``telemetry/``, ``wire/`` and ``core/``.
"""

from __future__ import annotations

from .proxy import Proxy, open_proxy

__all__ = ["Proxy", "open_proxy"]
