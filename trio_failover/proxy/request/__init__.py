"""A request's life in the shell: one workload, from its nursery to its answer.

``workload.py`` runs a workload's nursery and the watcher of its client;
``attempts.py`` is the nursery's body (the plan, a slot per attempt,
failover); ``milestones.py`` executes the core's verdict at each milestone
(an attempt failed, committed, a stream ended, the client gone);
``relay.py`` streams a committed response; ``answers.py`` writes the
answers the proxy makes itself. It may import ``nodes/`` (the board's
verbs, the slot queue, the silence watch), ``report.py`` and
``records.py`` of ``proxy/``, and ``telemetry/``, ``wire/`` and
``core/``; never ``fleet/`` or ``proxy.py``, which hold it.
"""
