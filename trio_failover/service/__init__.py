"""The Service layer: listeners, the admin endpoints, events, metrics and logs."""
