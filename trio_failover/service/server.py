"""Listeners and the server's lifetime: ``serve()`` for embedders and tests,
``run_server()`` for the command line.

The server nursery holds the long-lived tasks only: accept loops, the admin
listener and the connections they start. Graceful shutdown (hypercorn's
shape): stop accepting, close idle keep-alive connections, then give the
in-flight workloads ``shutdown_timeout`` by moving the connection nursery's
deadline; whatever still runs then is cancelled, which closes its sockets.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import signal
import ssl
import sys
from typing import Any

import attrs
import trio

from ..core.config import Config, split_host_port
from ..core.errors import ConfigError
from ..proxy.proxy import Proxy
from ..telemetry.logs import BatchedStreamHandler, FlushLogs, configure_logging, logger
from ..wire import sockopts
from ..wire.upstream import Connector
from .accept import ACCEPT_BATCH, accept_pending
from .admin import serve_admin
from .collector import tune_collector
from .history import History

# Errors of accept() that mean "out of resources, try again later" rather
# than "this listener is broken" (as trio.serve_listeners treats them).
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_PAUSE = 0.1


@attrs.frozen
class BoundAddresses:
    """Where the server listens (the real ports, also when port 0 was asked)."""

    client: tuple[str, int]
    admin: tuple[str, int] | None
    scheme: str = "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{_url_host(self.client[0])}:{self.client[1]}"

    @property
    def admin_url(self) -> str | None:
        if self.admin is None:
            return None
        return f"http://{_url_host(self.admin[0])}:{self.admin[1]}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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
    machine and no client key is set (SPEC 5b): anyone on that network can
    then run generations on every node.

    Args:
        config: the settings (its ``clients``).
        hosts: the addresses the client listener is bound to.
    """
    if config.clients or all(is_loopback(host) for host in hosts):
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


EXPIRY_TICK = 1.0


async def expire_cooldowns_every(proxy: Proxy, interval: float) -> None:
    """Let ``proxy`` notice expired cooldowns every ``interval`` seconds, forever.

    The cooldown table computes expiry from ``now`` when asked (no timer per
    node); this one task asks, so an idle proxy still publishes its
    ``ready`` node events and keeps the cooling gauge current, whether or
    not an admin listener is open. While workloads wait in the queue it
    also asks at the moment each cooldown ends: a node turning ready may
    be what a waiter waits for, and noticing it dispatches the queue.
    """
    readiness = proxy.report.readiness
    tick = trio.current_time() + interval
    while True:
        with trio.move_on_at(min(tick, readiness.queue_wake_at())):
            await readiness.queue.wait_schedule_changed()
        now = trio.current_time()
        proxy.expire_cooldowns(now)
        if now >= tick:
            tick = now + interval


async def serve(
    config: Config,
    *,
    connector: Connector | None = None,
    proxy: Proxy | None = None,
    shutdown: trio.Event | None = None,
    history: History | None = None,
    task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until cancelled (or until ``shutdown`` is set, then drain).

    Args:
        config: the settings.
        connector: how to reach nodes (default: TCP/TLS).
        proxy: an existing ``Proxy`` to serve (for its events and status).
        shutdown: when set, stop accepting and drain for ``shutdown_timeout``.
        history: the dashboard's rings, which the admin listener samples
            and shows (default: 15 minutes at 10 s a point).
        task_status: receives the ``BoundAddresses`` once listening.
    """
    log_tls_warnings(config)
    proxy = proxy or Proxy(config, connector=connector)
    context = server_ssl_context(config)  # bad files fail before anything listens
    host, port = split_host_port(config.listen)
    try:
        listeners: list[trio.SocketListener] = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise _cannot_listen("client", "listen", config.listen, exc) from exc
    scheme = "https" if context else "http"
    bound = listeners[0].socket.getsockname()
    log_exposure_warning(config, [str(listener.socket.getsockname()[0]) for listener in listeners])
    limiter = trio.CapacityLimiter(config.max_connections)
    try:
        async with trio.open_nursery() as services:
            services.start_soon(expire_cooldowns_every, proxy, EXPIRY_TICK)
            # Idle node connections close when their node closes them or at
            # --pool-idle-timeout, with no traffic needed (SPEC 5 item 11).
            services.start_soon(proxy.pool.watch)
            # One task times every committed stream's --stream-idle-timeout
            # (without it, each stream runs a timer task of its own).
            services.start_soon(proxy.silence.watch)
            admin = None
            if config.admin_listen is not None:
                try:
                    # The admin listener also runs the sampler of the
                    # dashboard's history: none without it (sampler.py).
                    admin = await services.start(
                        functools.partial(serve_admin, history=history), proxy, config.admin_listen
                    )
                except OSError as exc:
                    raise _cannot_listen("admin", "admin-listen", config.admin_listen, exc) from exc
            addresses = BoundAddresses(client=(bound[0], bound[1]), admin=admin, scheme=scheme)
            # Once both listeners are bound: a proxy that cannot listen checks nothing.
            await services.start(proxy.run_discovery)  # returns at once when off
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        acceptors.start_soon(
                            _accept_loop, listener, connections, proxy, limiter, context, scheme
                        )
                    task_status.started(addresses)
                    if shutdown is None:
                        await trio.sleep_forever()
                    await shutdown.wait()
                    acceptors.cancel_scope.cancel()
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
                logger.info("draining", extra={"fields": {"timeout_s": config.shutdown_timeout}})
                proxy.begin_drain()
                connections.cancel_scope.deadline = trio.current_time() + config.shutdown_timeout
            services.cancel_scope.cancel()
    finally:
        # Cancelled from outside (an embedder's scope, a test): still no leak.
        for listener in listeners:
            await trio.aclose_forcefully(listener)
        await proxy.pool.aclose()


def _cannot_listen(listener: str, option: str, address: str, exc: OSError) -> ConfigError:
    # A taken or foreign address is a setting to change, like any bad value:
    # exit 2, naming the listener and the option that chose the address.
    reason = exc.strerror or str(exc)
    return ConfigError(
        option, address, f"cannot listen ({listener} listener): {reason}", "--" + option
    )


async def _accept_loop(
    listener: trio.SocketListener,
    connections: trio.Nursery,
    proxy: Proxy,
    limiter: trio.CapacityLimiter,
    context: ssl.SSLContext | None,
    scheme: str,
) -> None:
    # Accept only while below max_connections: further clients wait in the
    # kernel's backlog instead of being accepted and dropped.
    def start(stream: trio.SocketStream, token: object) -> None:
        connections.start_soon(_handle, stream, proxy, limiter, token, context, scheme)

    while True:
        token = object()
        try:
            limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            await limiter.acquire_on_behalf_of(token)
        try:
            stream = await listener.accept()
        except OSError as exc:
            limiter.release_on_behalf_of(token)
            if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                raise
            logger.error("accept failed, retrying", extra={"fields": {"error": str(exc)}})
            await trio.sleep(ACCEPT_RETRY_PAUSE)
            continue
        except BaseException:
            limiter.release_on_behalf_of(token)
            raise
        start(stream, token)
        accept_pending(listener, limiter, start, ACCEPT_BATCH - 1)


async def _handle(
    stream: trio.SocketStream,
    proxy: Proxy,
    limiter: trio.CapacityLimiter,
    token: object,
    context: ssl.SSLContext | None,
    scheme: str,
) -> None:
    try:
        sockopts.apply_client_options(stream.socket)
        peer: Any = stream.socket.getpeername()
        address = str(peer[0]) if isinstance(peer, tuple) else None
        client: trio.abc.Stream = stream
        if context is not None:
            client = trio.SSLStream(stream, context, server_side=True, https_compatible=True)
        await proxy.handle_connection(client, client_address=address, scheme=scheme)
    except (trio.BrokenResourceError, OSError) as exc:
        logger.debug("connection ended", extra={"fields": {"error": str(exc)}})
    except Exception:
        # One connection's failure (a bug, an error nobody mapped) closes
        # that connection only; escaping, it would cancel the connection
        # nursery and with it the listener and every other client.
        logger.exception("connection failed")
    finally:
        await trio.aclose_forcefully(stream)
        limiter.release_on_behalf_of(token)


def run_server(config: Config) -> int:
    """Run the proxy in the foreground until SIGINT/SIGTERM; returns the exit code.

    The first signal drains (``shutdown_timeout``) and exits 0; a second one
    cancels what still runs and exits 1.
    """
    secrets = [value for node in config.upstreams for value in node.headers.values()]
    secrets += [client.key for client in config.clients]
    secrets += [config.admin_token] if config.admin_token else []
    handler = configure_logging(config.log_format, config.log_level, secrets=secrets, batched=True)
    assert isinstance(handler, BatchedStreamHandler)
    # This process is ours: log records need not look up what no line of
    # ours prints (the process id is a system call per record).
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    tune_collector()  # nor need its collector walk every object every few seconds (issue 33)
    # Trio hands errors out of nurseries as exception groups: a settings file
    # that cannot be loaded (exit 2, one line, as for any bad value) or a port
    # that is taken (exit 1) arrive wrapped.
    bad_setting: ConfigError | None = None
    cannot_listen: OSError | None = None
    try:
        return _run_flushing(config, handler)
    except* ConfigError as group:
        bad_setting = next(exc for exc in _leaves(group) if isinstance(exc, ConfigError))
    except* OSError as group:
        cannot_listen = next(exc for exc in _leaves(group) if isinstance(exc, OSError))
    if bad_setting is not None:
        print(f"trio-failover: error: {bad_setting}", file=sys.stderr)
        return 2
    logger.error("cannot listen", extra={"fields": {"error": str(cannot_listen)}})
    handler.flush()
    return 1


def _run_flushing(config: Config, handler: BatchedStreamHandler) -> int:
    try:
        return trio.run(_main, config, instruments=[FlushLogs(handler)])
    finally:
        handler.flush()


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def _main(config: Config) -> int:
    shutdown = trio.Event()
    forced = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                nonlocal forced
                async for signum in signals:
                    if shutdown.is_set():
                        logger.warning("second signal: stopping now")
                        forced = True
                        nursery.cancel_scope.cancel()
                        return
                    logger.info(f"{signal.Signals(signum).name}: shutting down")
                    shutdown.set()

            nursery.start_soon(watch_signals)
            async with trio.open_nursery() as server:
                addresses: BoundAddresses = await server.start(
                    functools.partial(serve, config, shutdown=shutdown)
                )
                logger.info(f"listening on {addresses.client_url}")
                if addresses.admin_url:
                    logger.info(f"admin on {addresses.admin_url}")
                for handler in logger.handlers:
                    handler.flush()  # the startup lines leave now, not with the next pass
            nursery.cancel_scope.cancel()
    return 1 if forced else 0
