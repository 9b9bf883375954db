"""Listeners and the server's lifetime: ``serve()`` for embedders and tests,
``run_server()`` for the command line.

The server nursery holds the long-lived tasks only: accept loops, the admin
listener and the connections they start. Graceful shutdown (hypercorn's
shape): stop accepting, close idle keep-alive connections, then give the
in-flight workloads ``shutdown_timeout`` by moving the connection nursery's
deadline; whatever still runs then is cancelled, which closes its sockets.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable
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
from .listener_setup import (  # re-exported: the names embedders and tests use
    is_loopback as is_loopback,
)
from .listener_setup import (
    log_exposure_warning,
)
from .listener_setup import (
    log_tls_warnings as log_tls_warnings,
)
from .listener_setup import (
    server_ssl_context as server_ssl_context,
)
from .reloader import ListenerTLS, Loader, Reloader, placed, tls_digest

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


@attrs.frozen
class InheritedSockets:
    """A ``--workers`` worker's listeners, bound and listening by its supervisor.

    ``admin_until``: for the worker that serves the fleet's admin listener,
    what it awaits, once drained, before closing that listener (the other
    workers' end), within what is left of ``--shutdown-timeout``.
    """

    client: socket.socket
    admin: socket.socket | None = None
    admin_until: Callable[[], Awaitable[None]] | None = None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve(
    config: Config,
    *,
    connector: Connector | None = None,
    proxy: Proxy | None = None,
    shutdown: trio.Event | None = None,
    history: History | None = None,
    loader: Loader | None = None,
    reloads: trio.abc.ReceiveChannel[None] | None = None,
    sockets: InheritedSockets | None = None,
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
        loader: reads the settings again for a reload (``reloader.py``);
            with ``watch_config``, its file is watched.
        reloads: one message per reload asked for (``SIGHUP``), with ``loader``.
        sockets: listeners already bound and listening (a ``--workers``
            worker's, from its supervisor), served instead of binding.
        task_status: receives the ``BoundAddresses`` once listening.
    """
    log_tls_warnings(config)
    proxy = proxy or Proxy(config, connector=connector)
    # Bad files fail before anything listens; a reload swaps the context.
    tls = ListenerTLS(server_ssl_context(config), tls_digest(config))
    host, port = split_host_port(config.listen)
    try:
        listeners: list[trio.SocketListener] = (
            [trio.SocketListener(trio.socket.from_stdlib_socket(sockets.client))]
            if sockets is not None
            else await trio.open_tcp_listeners(port, host=host)
        )
    except OSError as exc:
        raise _cannot_listen("client", "listen", config.listen, exc) from exc
    serving = _Serving(
        proxy,
        config,
        listeners,
        tls,
        shutdown,
        history,
        sockets.admin if sockets else None,
        sockets.admin_until if sockets else None,
    )
    try:
        await _serve_listeners(serving, loader, reloads, task_status)
    except BaseExceptionGroup as group:
        # The admin listener binds inside the services' nursery, which hands
        # its ConfigError (a taken port) out wrapped: given to ``start`` as
        # the client listener's is, alone and with its cause.
        leaves = _leaves(group)
        if len(leaves) == 1 and isinstance(leaves[0], ConfigError):
            raise leaves[0] from leaves[0].__cause__
        raise
    finally:
        # Cancelled from outside (an embedder's scope, a test): still no leak.
        for listener in listeners:
            await trio.aclose_forcefully(listener)


@attrs.frozen
class _Serving:
    """What ``serve`` hands ``_serve_listeners``: the proxy and what it listens with."""

    proxy: Proxy
    config: Config
    listeners: list[trio.SocketListener]
    tls: ListenerTLS
    shutdown: trio.Event | None
    history: History | None
    admin_sock: socket.socket | None
    admin_until: Callable[[], Awaitable[None]] | None


async def _serve_listeners(
    serving: _Serving,
    loader: Loader | None,
    reloads: trio.abc.ReceiveChannel[None] | None,
    task_status: trio.TaskStatus[BoundAddresses],
) -> None:
    """Accept on the listeners (and the admin listener) until ``shutdown``, then drain.

    The proxy runs (``Proxy.run``) from when both listeners are bound to
    when the connections ended: a proxy that cannot listen checks nothing.
    One that the caller runs already is only served.
    """
    proxy, config, listeners, tls = serving.proxy, serving.config, serving.listeners, serving.tls
    scheme = "https" if tls.context else "http"
    bound = listeners[0].socket.getsockname()
    log_exposure_warning(config, [str(listener.socket.getsockname()[0]) for listener in listeners])
    limiter = trio.CapacityLimiter(config.max_connections)
    async with trio.open_nursery() as services:
        if loader is not None:
            _start_reloads(services, Reloader(proxy, loader, tls, server_ssl_context), reloads)
        admin = None
        if config.admin_listen is not None:
            try:
                # The admin listener also runs the sampler of the
                # dashboard's history: none without it (sampler.py).
                admin = await services.start(
                    functools.partial(
                        serve_admin, history=serving.history, sock=serving.admin_sock
                    ),
                    proxy,
                    config.admin_listen,
                )
            except OSError as exc:
                raise _cannot_listen("admin", "admin-listen", config.admin_listen, exc) from exc
        addresses = BoundAddresses(client=(bound[0], bound[1]), admin=admin, scheme=scheme)
        async with contextlib.AsyncExitStack() as lifetime:
            if not proxy.running:
                await lifetime.enter_async_context(proxy)
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        acceptors.start_soon(
                            _accept_loop, listener, connections, proxy, limiter, tls, scheme
                        )
                    task_status.started(addresses)
                    if serving.shutdown is None:
                        await trio.sleep_forever()
                    await serving.shutdown.wait()
                    acceptors.cancel_scope.cancel()
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
                timeout = proxy.config.shutdown_timeout  # a reload may have changed it
                logger.info("draining", extra={"fields": {"timeout_s": timeout}})
                proxy.begin_drain()
                deadline = connections.cancel_scope.deadline = trio.current_time() + timeout
            if admin is not None and serving.admin_until is not None:
                # The fleet's admin listener says 503 until its last worker ends.
                with trio.move_on_at(deadline):
                    await serving.admin_until()
        services.cancel_scope.cancel()


def _start_reloads(
    services: trio.Nursery, reloader: Reloader, reloads: trio.abc.ReceiveChannel[None] | None
) -> None:
    if reloads is not None:
        services.start_soon(reloader.run, reloads)
    path = reloader.load.path
    if reloader.proxy.config.watch_config:
        if path is None:
            logger.warning("--watch-config without a config file: nothing to watch")
        else:
            services.start_soon(reloader.watch_file, path)


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
    tls: ListenerTLS | None,
    scheme: str,
) -> None:
    # Accept only while below max_connections: further clients wait in the
    # kernel's backlog instead of being accepted and dropped.
    def start(stream: trio.SocketStream, token: object) -> None:
        # Read at each accept: a reload may have swapped the certificate.
        context = tls.context if tls is not None else None
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


def run_server(
    config: Config,
    *,
    loader: Loader | None = None,
    sockets: InheritedSockets | None = None,
    on_listening: Callable[[BoundAddresses], None] | None = None,
) -> int:
    """Run the proxy in the foreground until SIGINT/SIGTERM; returns the exit code.

    The first signal drains (``shutdown_timeout``) and exits 0; a second one
    cancels what still runs and exits 1. With ``loader``, ``SIGHUP`` reloads
    (``reloader.py``); without, it is logged and ignored. A ``--workers``
    worker (``service/workers.py``) passes the ``sockets`` its supervisor
    bound, and ``on_listening`` to tell it when it serves, instead of the
    ``listening on`` lines, which the supervisor prints once.
    """
    secrets = [value for node in config.upstreams for value in node.headers.values()]
    secrets += [client.key for client in config.keyed_clients if client.key is not None]
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
        return _run_flushing(config, handler, loader, sockets, on_listening)
    except* ConfigError as group:
        bad_setting = next(exc for exc in _leaves(group) if isinstance(exc, ConfigError))
    except* OSError as group:
        cannot_listen = next(exc for exc in _leaves(group) if isinstance(exc, OSError))
    if bad_setting is not None:
        bad_setting = placed(loader, bad_setting)  # where the value was set, not only its flag
        print(f"trio-failover: error: {bad_setting}", file=sys.stderr)
        return 2
    logger.error("cannot listen", extra={"fields": {"error": str(cannot_listen)}})
    handler.flush()
    return 1


def _run_flushing(
    config: Config,
    handler: BatchedStreamHandler,
    loader: Loader | None,
    sockets: InheritedSockets | None,
    on_listening: Callable[[BoundAddresses], None] | None,
) -> int:
    try:
        main = functools.partial(_main, config, loader, sockets, on_listening)
        return trio.run(main, instruments=[FlushLogs(handler)])
    finally:
        handler.flush()


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def _main(
    config: Config,
    loader: Loader | None = None,
    sockets: InheritedSockets | None = None,
    on_listening: Callable[[BoundAddresses], None] | None = None,
) -> int:
    shutdown = trio.Event()
    forced = False
    ask_reload, reloads = trio.open_memory_channel[None](1)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                nonlocal forced
                async for signum in signals:
                    if signum == signal.SIGHUP:  # reload; one waits at most
                        if loader is None:
                            logger.warning("SIGHUP: nothing to reload from, ignored")
                        else:
                            with contextlib.suppress(trio.WouldBlock):
                                ask_reload.send_nowait(None)
                        continue
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
                    functools.partial(
                        serve,
                        config,
                        shutdown=shutdown,
                        loader=loader,
                        reloads=reloads,
                        sockets=sockets,
                    )
                )
                if on_listening is not None:
                    on_listening(addresses)
                else:
                    logger.info(f"listening on {addresses.client_url}")
                    if addresses.admin_url:
                        logger.info(f"admin on {addresses.admin_url}")
                for handler in logger.handlers:
                    handler.flush()  # the startup lines leave now, not with the next pass
            nursery.cancel_scope.cancel()
    return 1 if forced else 0
