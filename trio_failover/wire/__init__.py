"""HTTP/1 and streams: h11 framing, node connections and sockets, no policy.

The one h11 receive loop, the client and node connections, the pool,
socket options, the proxy's own GETs and the Redis client. It may import
``core/`` only; it logs through the standard ``logging`` module, not
``telemetry/``.
"""
