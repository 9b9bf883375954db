"""The nodes: the board, what feeds it, and what runs on the nodes' state.

``board.py``'s ``NodeBoard`` holds every node's state and is its only
writer; ``node_news.py`` tells its changes (events, logs, gauges).
``discovery.py`` (the checks), ``liveness.py`` (a silent node asked),
``engine_reader.py`` (the engines' signals) and ``ticker.py`` (cooldown
expiry) feed it. ``queue.py`` holds each node's slots and the workloads
waiting for one, ``silence.py`` times every wait for a node, ``lists.py``
answers the fleet's model lists and ``status.py`` builds ``/status``. It
may import ``report.py`` and ``records.py`` of ``proxy/``, and
``telemetry/``, ``wire/`` and ``core/``; never ``request/`` or ``fleet/``:
they use the nodes, the nodes call nothing of theirs.
"""
