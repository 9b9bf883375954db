"""Telemetry: events, metrics, logs and traces, the sinks the shell writes to.

Listeners, never writers of what a decision reads. It may import ``core/``
only; ``wire/`` is its sibling and neither imports the other.
"""
