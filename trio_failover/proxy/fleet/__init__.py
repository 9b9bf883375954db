"""The replicas (docs/replicas.md): the node board and the slots shared over Redis.

``fleet.py``'s ``Fleet`` joins one replica to the others: it publishes the
board's changes and applies theirs, and takes each slot as a lease;
``shared_state.py`` is its Redis side (join, heartbeat, leases, releases
owed to a rejoin), ``spare_leases.py`` an ended attempt's lease kept for
the node's next attempt. Only a proxy with ``--state redis://...`` imports
these modules (they pull in the Redis client), so this file imports
nothing. It may import ``nodes/`` (the board and the slot queue it
shares), ``report.py`` and ``records.py`` of ``proxy/``, and
``telemetry/``, ``wire/`` and ``core/``; never ``request/`` or
``proxy.py``.
"""
