"""The Service layer: the listeners, their drain, and the admin endpoints."""
