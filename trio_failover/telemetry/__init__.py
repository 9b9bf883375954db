"""Telemetry: events, metrics, logs and traces, the sinks the shell writes to."""
