"""What the listeners need before they accept: the client listener's TLS
context, and the startup warnings about TLS settings and exposure.

``server.serve`` calls these once at startup (a reload builds a new TLS
context with ``server_ssl_context`` too).
"""

from __future__ import annotations

import ipaddress
import ssl

from ..core.config import Config
from ..core.errors import ConfigError
from ..telemetry.logs import logger

__all__ = ["is_loopback", "log_exposure_warning", "log_tls_warnings", "server_ssl_context"]


def server_ssl_context(config: Config) -> ssl.SSLContext | None:
    """The TLS context of the client listener, if ``tls_cert``/``tls_key`` are set.

    ``tls_key`` may name the same file as ``tls_cert`` when that file holds
    both. The context takes TLS 1.2 or newer and offers ALPN ``http/1.1``
    only (a client that asks for ``h2`` alone gets no ALPN answer and speaks
    HTTP/1.1 anyway, or leaves).

    Raises:
        ConfigError: a key without a certificate, or files that cannot be
            loaded as a matching certificate chain and unencrypted key.
    """
    if not config.tls_cert:
        if config.tls_key:
            raise ConfigError("tls-key", config.tls_key, "TLS needs --tls-cert as well")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        # An empty passphrase instead of none: without one, OpenSSL would
        # prompt on the terminal for an encrypted key and hang a service.
        context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: b"")
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(
            "tls-cert", config.tls_cert, f"cannot load the certificate and key ({exc})"
        ) from exc
    context.set_alpn_protocols(["http/1.1"])
    # Renegotiation buys an HTTP/1.1 proxy nothing and costs a handshake's
    # CPU per request of a hostile client; OpenSSL 3 already refuses
    # client-initiated ones, older versions do not.
    context.options |= ssl.OP_NO_RENEGOTIATION
    return context


def log_tls_warnings(config: Config) -> None:
    """Warn, once at startup, about nodes whose TLS settings weaken or do nothing.

    ``insecure_skip_verify`` accepts any certificate (anyone on the path can
    read the node's traffic, credentials included); ``ca_file`` and
    ``insecure_skip_verify`` on an http:// node are ignored, which usually
    means the URL was meant to be https://.
    """
    for node in config.upstreams:
        fields = {"node": node.name}
        if node.scheme == "https" and node.insecure_skip_verify:
            logger.warning(
                "TLS certificate verification is off for this node (insecure_skip_verify)",
                extra={"fields": fields},
            )
        elif node.scheme != "https" and (node.ca_file or node.insecure_skip_verify):
            logger.warning(
                "ca_file/insecure_skip_verify are ignored for an http:// node",
                extra={"fields": fields},
            )


def log_exposure_warning(config: Config, hosts: list[str]) -> None:
    """Warn, once at startup, when the client listener is reachable beyond this
    machine and no client key is set: anyone on that network can
    then run generations on every node.

    Args:
        config: the settings (its ``clients``).
        hosts: the addresses the client listener is bound to.
    """
    if config.keyed_clients or all(is_loopback(host) for host in hosts):
        return
    logger.warning(
        "the client listener is not on a loopback address and no API key is set: "
        "anyone who can reach it can use every node (see --api-key, docs/security.md)",
        extra={"fields": {"listen": config.listen}},
    )


def is_loopback(host: str) -> bool:
    """Whether a bound address is a loopback one (``127.0.0.0/8``, ``::1``)."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
