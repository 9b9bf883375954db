"""Opening a connection to a node: TCP, socket options, and TLS for https:// nodes.

``Connector`` is the seam: the proxy opens node connections only through
one, ``TCPConnector`` by default, ``testing.MemoryConnector`` in tests.
"""

from __future__ import annotations

import ipaddress
import ssl
from typing import Protocol

import trio

from ..core import errors
from ..core.config import Config, Upstream
from . import sockopts


class Connector(Protocol):
    """Opens a byte stream to a node. Swap it to run the proxy in memory."""

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        """Open a connection to ``node``; raise OSError (or ssl.SSLError) on failure."""
        ...


async def open_tcp(host: str, port: int) -> trio.SocketStream:
    """A TCP connection to ``host:port``.

    A host name goes through ``trio.open_tcp_stream`` (the resolver, then
    Happy Eyeballs across the addresses). An IP address, the usual way to
    name a GPU box, is connected directly: no resolver call and no racing
    tasks, which is most of the cost of a new connection.

    Raises:
        OSError: the connection failed (the errno is kept).
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return await trio.open_tcp_stream(host, port)
    family = trio.socket.AF_INET6 if address.version == 6 else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot connect to {host}:{port}: {exc.strerror}") from exc
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


class TCPConnector:
    """The real connector: TCP (plus TLS for https:// nodes) with socket options.

    TLS for an https:// node: the system trust store, or only the node's
    ``ca_file`` when it has one; the certificate must name the URL's host
    (SNI carries that host too); ALPN offers ``http/1.1`` only. With
    ``insecure_skip_verify`` any certificate is accepted (``server.serve``
    warns about such nodes at startup).

    Raises:
        ConfigError: from the constructor, when a node's ``ca_file`` cannot
            be loaded. Contexts are built up front so that a bad CA file stops
            the proxy before it listens instead of failing every attempt.
    """

    def __init__(self, config: Config) -> None:
        self._dead_peer_timeout = config.dead_peer_timeout
        # Keyed by what makes contexts differ, so nodes that share a CA file
        # (or the system store) share one context and its session cache.
        self._ssl_contexts: dict[tuple[str | None, bool], ssl.SSLContext] = {}
        for node in config.upstreams:
            if node.scheme == "https":
                self.ssl_context(node)

    def reconfigure(self, config: Config) -> None:
        """A reload: contexts for the new nodes' TLS options, the new dead-peer timeout.

        Raises:
            ConfigError: a node's ``ca_file`` cannot be loaded; nothing changed then.
        """
        fresh = TCPConnector(config)
        self._ssl_contexts, self._dead_peer_timeout = fresh._ssl_contexts, fresh._dead_peer_timeout

    def ssl_context(self, node: Upstream) -> ssl.SSLContext:
        """The TLS context for an https:// node (verifying unless configured not to)."""
        key = (node.ca_file, node.insecure_skip_verify)
        context = self._ssl_contexts.get(key)
        if context is None:
            try:
                # With a cafile, create_default_context loads that file
                # instead of the system store: a private CA is pinned.
                context = ssl.create_default_context(cafile=node.ca_file)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise errors.ConfigError(
                    "upstream.ca_file",
                    node.ca_file,
                    f"cannot load CA certificates ({exc})",
                    f"upstream {node.name}",
                ) from exc
            if node.insecure_skip_verify:
                context.check_hostname = False  # must precede CERT_NONE
                context.verify_mode = ssl.CERT_NONE
            context.set_alpn_protocols(["http/1.1"])
            self._ssl_contexts[key] = context
        return context

    async def connect(self, node: Upstream) -> trio.abc.Stream:
        """TCP connect, socket options, and the TLS handshake for https:// nodes.

        Cancellation: the caller's connect deadline covers the handshake too;
        a cancelled handshake closes the socket (the half-made TLS stream is
        unusable anyway).
        """
        tcp = await open_tcp(node.host, node.port)
        sockopts.apply_upstream_options(tcp.socket, self._dead_peer_timeout)
        if node.scheme != "https":
            return tcp
        # https_compatible: many HTTPS servers close without a TLS
        # close_notify; HTTP framing (Content-Length, chunked) already tells
        # a complete message from a cut one, so a bare EOF reads as EOF (and
        # an early one is then closed_early, not a TLS error), as in every
        # HTTPS client. An IP-literal host gets no SNI (RFC 6066 section 3)
        # but is still checked against the certificate's IP addresses.
        tls = trio.SSLStream(
            tcp, self.ssl_context(node), server_hostname=node.host, https_compatible=True
        )
        try:
            await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return tls
