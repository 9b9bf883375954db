"""``--workers N``: a supervisor process and N worker processes on the same listeners.

What it does and why (spawn, not fork; one ``SO_REUSEPORT`` socket per
worker, kept by the supervisor; printed once; restarts; stopping; reload;
``/status``'s workers; one ``/metrics``) is told in docs/replicas.md
("Workers"). Where the code does it:

- ``_Supervisor`` binds the listeners, starts each worker as
  ``python -P -m trio_failover.service.workers`` with its sockets and the
  settings in an anonymous memory file (as ``cli/reexec.py`` does), restarts
  one that exits (``core/workers.restart_delay``) and passes signals on.
- A worker holds the command line's ``SettingsLoader``; ``_WorkerLoader``
  makes what it reads this worker's settings
  (``core/workers.worker_reload_config``).
- The first worker gets the roster pipe's read end (``roster.py``) and,
  as every worker, the run's private ``PROMETHEUS_MULTIPROC_DIR``; a dead
  worker's gauges are dropped (``mark_process_dead``) before its restart.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable

import attrs
import trio
from prometheus_client.multiprocess import mark_process_dead

from ..core.config import Config, split_host_port
from ..core.errors import ConfigError
from ..core.workers import STEADY_AFTER, restart_delay, worker_config, worker_reload_config
from ..telemetry.logs import configure_logging, logger
from ..telemetry.metrics import share_in
from .reloader import Loader, placed
from .roster import Roster, WorkerEntry, encode, install, send
from .server import BoundAddresses, InheritedSockets, run_server, server_ssl_context

__all__ = ["Listeners", "main", "run_workers"]

READY = b"r"
BACKLOG = 4096
# prometheus-client's switch to its multiprocess mode (telemetry/metrics.py).
METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"


@attrs.frozen
class Listeners:
    """The sockets a supervisor binds once: one client socket per worker, one admin."""

    clients: tuple[socket.socket, ...]
    admin: socket.socket | None
    addresses: BoundAddresses

    def close(self) -> None:
        for sock in (*self.clients, *([self.admin] if self.admin else [])):
            sock.close()


def _listening(host: str, port: int, reuse_port: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_listeners(config: Config) -> Listeners:
    """Bind and listen: ``config.workers`` client sockets on one port, and the admin socket.

    Raises:
        ConfigError: an address cannot be bound (taken, not this host's...),
            naming the option that chose it, as a single proxy does.
    """
    host, port = split_host_port(config.listen)
    clients: list[socket.socket] = []
    admin = None
    option, address = "listen", config.listen
    try:
        for _ in range(config.workers):
            clients.append(_listening(host, port, reuse_port=True))
            port = clients[0].getsockname()[1]  # a port 0 is chosen once
        if config.admin_listen is not None:
            option, address = "admin-listen", config.admin_listen
            admin = _listening(*split_host_port(config.admin_listen, option), reuse_port=False)
    except OSError as exc:
        for sock in clients:
            sock.close()
        which = "client" if option == "listen" else "admin"
        reason = exc.strerror or str(exc)
        raise ConfigError(
            option, address, f"cannot listen ({which} listener): {reason}", "--" + option
        ) from exc
    client_name = clients[0].getsockname()
    admin_name = admin.getsockname() if admin is not None else None
    addresses = BoundAddresses(
        client=(client_name[0], client_name[1]),
        admin=(admin_name[0], admin_name[1]) if admin_name else None,
        scheme="https" if config.tls_cert else "http",
    )
    return Listeners(tuple(clients), admin, addresses)


@attrs.define
class _Supervisor:
    """The running workers, and whether they are being stopped."""

    config: Config
    listeners: Listeners
    settings_fd: int
    lifeline: int  # the read end of a pipe whose write end only the supervisor holds
    metrics_dir: str  # where the workers' metrics meet (the module docstring)
    processes: dict[int, trio.Process] = attrs.Factory(dict)
    entries: dict[int, WorkerEntry] = attrs.Factory(dict)  # what /status lists (roster.py)
    roster_fd: int | None = None  # the write end of the first worker's roster pipe
    stopped: trio.Event = attrs.Factory(trio.Event)
    ready: int = 0
    serving: set[int] = attrs.Factory(set)  # the workers that said they serve (SIGHUP-ready)
    reload_asked: set[int] = attrs.Factory(set)  # SIGHUP came while they were starting
    failed: int | None = None  # the exit status of a worker that never started

    async def keep(self, index: int, all_ready: trio.Event) -> None:
        """Run worker ``index``, and start it again whenever it dies, until stopping."""
        failures, first = 0, True
        self.entries[index] = WorkerEntry(index)
        while not self.stopped.is_set():
            started = trio.current_time()
            served, status = await self._run_once(index, first, all_ready)
            if self.stopped.is_set():
                return
            if not served and first:
                self.failed = status or 1
                self.stop()
                return
            lived = trio.current_time() - started
            failures = 1 if lived >= STEADY_AFTER else failures + 1
            delay = restart_delay(failures, lived)
            logger.warning(
                "worker exited: starting it again",
                extra={"fields": {"worker": index, "status": status, "in_s": delay}},
            )
            first = first and not served
            with trio.move_on_after(delay):
                await self.stopped.wait()
            self.entries[index].restarts += not self.stopped.is_set()

    async def _run_once(self, index: int, first: bool, all_ready: trio.Event) -> tuple[bool, int]:
        """One life of worker ``index``: whether it served, and its exit status."""
        read_end, write_end = os.pipe()
        admin = self.listeners.admin if index == 0 else None
        roster_read, roster_write = os.pipe() if index == 0 else (-1, -1)
        fds = [self.settings_fd, self.lifeline, write_end, self.listeners.clients[index].fileno()]
        fds += [admin.fileno() if admin is not None else -1, roster_read]
        command = [sys.executable, "-P", "-m", __name__, *map(str, fds), str(index)]
        try:
            process = await trio.lowlevel.open_process(
                command,
                pass_fds=[fd for fd in fds if fd >= 0],
                start_new_session=True,
                env={**os.environ, METRICS_DIR: self.metrics_dir},
            )
        except BaseException:
            os.close(read_end)
            if roster_write >= 0:
                os.close(roster_write)
            raise
        finally:
            os.close(write_end)
            if roster_read >= 0:
                os.close(roster_read)
        if roster_write >= 0:
            self._new_roster(roster_write)
        self.processes[index] = process
        self.entries[index].pid = process.pid
        self._publish()
        if self.stopped.is_set():  # stopped while it was being started
            process.send_signal(signal.SIGTERM)
        served = False
        try:
            async with trio.lowlevel.FdStream(read_end) as ready:
                served = await ready.receive_some(1) == READY
            if served:  # told to the first worker before it is logged
                self.entries[index].serving = True
                self._publish()
                logger.info(
                    "worker serving", extra={"fields": {"worker": index, "pid": process.pid}}
                )
                self.serving.add(index)
                if index in self.reload_asked:  # it may have read the file before the change
                    self.reload_asked.discard(index)
                    self._hang_up(process)
            if served and first:
                self.ready += 1
                if self.ready == len(self.listeners.clients):
                    all_ready.set()
            status = await process.wait()
        finally:
            # Its gauges said what it held; it holds nothing now.
            mark_process_dead(process.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
            self.processes.pop(index, None)
            self.serving.discard(index)
            self.reload_asked.discard(index)  # its successor reads the file as it starts
            self.entries[index].pid, self.entries[index].serving = None, False
            self._publish()
        return served, status

    def reload(self) -> None:
        """``SIGHUP``: pass it on to every worker, each of which reads the settings again.

        Only to a worker that serves: one still starting has no handler yet,
        and ``SIGHUP``'s default would end it. It gets the signal once it
        says it serves.
        """
        logger.info(
            "SIGHUP: reloading the workers", extra={"fields": {"workers": len(self.processes)}}
        )
        for index, process in self.processes.items():
            if index in self.serving:
                self._hang_up(process)
            else:
                self.reload_asked.add(index)

    @staticmethod
    def _hang_up(process: trio.Process) -> None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGHUP)

    def _new_roster(self, fd: int) -> None:
        """The first worker's new roster pipe replaces its last life's."""
        os.set_blocking(fd, False)
        self.close_roster()
        self.roster_fd = fd

    def close_roster(self) -> None:
        if self.roster_fd is not None:
            os.close(self.roster_fd)
            self.roster_fd = None

    def _publish(self) -> None:
        """Tell the first worker the list of workers, as it now is (roster.py)."""
        if self.roster_fd is not None:
            send(self.roster_fd, encode(list(self.entries.values())))

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop restarting, and pass ``signum`` on to every worker."""
        self.stopped.set()
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)


async def _supervise(
    config: Config, listeners: Listeners, settings_fd: int, lifeline: int, metrics_dir: str
) -> int:
    supervisor = _Supervisor(config, listeners, settings_fd, lifeline, metrics_dir)
    all_ready = trio.Event()
    try:
        return await _supervised(supervisor, all_ready)
    finally:
        supervisor.close_roster()


async def _supervised(supervisor: _Supervisor, all_ready: trio.Event) -> int:
    config, listeners = supervisor.config, supervisor.listeners
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def announce() -> None:
                await all_ready.wait()
                if not supervisor.stopped.is_set():
                    _log_listening(listeners.addresses, config.workers)

            async def watch_signals() -> None:
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        supervisor.reload()
                        continue
                    logger.info(
                        f"{signal.Signals(signum).name}: stopping the workers",
                        extra={"fields": {"workers": len(supervisor.processes)}},
                    )
                    supervisor.stop(signal.SIGTERM)

            nursery.start_soon(announce)
            nursery.start_soon(watch_signals)
            # Each keeper returns once stopping and its worker is gone.
            async with trio.open_nursery() as keepers:
                for index in range(config.workers):
                    keepers.start_soon(supervisor.keep, index, all_ready)
            nursery.cancel_scope.cancel()
    return supervisor.failed or 0


def _log_listening(addresses: BoundAddresses, workers: int) -> None:
    logger.info(f"listening on {addresses.client_url}", extra={"fields": {"workers": workers}})
    if addresses.admin_url:
        logger.info(f"admin on {addresses.admin_url}")
    for handler in logger.handlers:
        handler.flush()


def run_workers(config: Config, loader: Loader | None = None) -> int:
    """The supervisor of ``config.workers`` workers, in the foreground; returns the exit code.

    A bad TLS file or an address that cannot be bound is exit 2 here, with
    one line, before any worker starts. ``loader`` (the command line's
    ``SettingsLoader``, a plain value) goes to every worker: with it, each
    reloads on the ``SIGHUP`` passed on, and watches the file itself with
    ``--watch-config``.
    """
    configure_logging(config.log_format, config.log_level)
    try:
        server_ssl_context(config)
        listeners = bind_listeners(config)
    except ConfigError as exc:
        print(f"trio-failover: error: {placed(loader, exc)}", file=sys.stderr)
        return 2
    settings_fd = os.memfd_create("trio-failover-config", 0)
    lifeline, lifeline_end = os.pipe()  # not inherited: the workers get only the read end
    metrics_dir = tempfile.mkdtemp(prefix="trio-failover-metrics-")
    try:
        with os.fdopen(os.dup(settings_fd), "wb") as file:
            pickle.dump((config, loader), file)
        return trio.run(_supervise, config, listeners, settings_fd, lifeline, metrics_dir)
    finally:
        for fd in (settings_fd, lifeline, lifeline_end):
            os.close(fd)
        listeners.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


# -- the worker's side ---------------------------------------------------------------


def _read_settings(fd: int) -> tuple[Config, Loader | None]:
    """The settings in the supervisor's memory file, read without moving the shared offset."""
    data = b""
    while chunk := os.pread(fd, 1 << 20, len(data)):
        data += chunk
    config, loader = pickle.loads(data)  # written by our own supervisor, before our start
    if not isinstance(config, Config):
        raise TypeError(f"expected a Config, read {type(config).__name__}")
    return config, loader


@attrs.frozen
class _WorkerLoader:
    """A worker's reload: the program's loader, its result as ``worker_config`` makes it."""

    load: Loader
    program: Config
    index: int

    @property
    def path(self) -> str | None:
        return self.load.path

    def __call__(self) -> Config:
        new = self.load()
        return worker_reload_config(self.program, new, self.index)

    def placed(self, error: ConfigError) -> ConfigError:
        return placed(self.load, error)


def _current_settings(loader: _WorkerLoader, started_with: Config) -> Config:
    """What a worker starts with: the file as it reads now (a worker started again after
    a reload must not go back to the settings of the program's start), else the start's."""
    try:
        return loader()
    except ConfigError as exc:
        configure_logging(started_with.log_format, started_with.log_level)
        logger.warning(
            "worker: the settings do not read now; starting with those of the program's start",
            extra={"fields": {"error": " ".join(str(exc).splitlines())}},
        )
        return started_with


def _watch_lifeline(fd: int, gone: threading.Event) -> None:
    """In a thread: when the supervisor is gone (the pipe's end), set ``gone`` and drain
    as on SIGTERM.

    A pipe rather than Linux's ``PR_SET_PDEATHSIG``: that fires when the
    *thread* that started the worker ends, and Trio starts processes from
    its worker threads, which end when idle.
    """
    with contextlib.suppress(OSError):
        os.read(fd, 1)  # blocks until the supervisor's write end closes
    gone.set()
    os.kill(os.getpid(), signal.SIGTERM)


def _admin_until(roster: Roster | None) -> Callable[[], Awaitable[None]] | None:
    """What the first worker, drained, awaits before it closes the fleet's admin listener."""
    if roster is None:
        return None

    async def others_gone() -> None:
        if roster.others_running():
            logger.info("drained: the admin listener stays until the other workers end")
            await roster.others_gone()

    return others_gone


def main(argv: list[str]) -> int:
    """A worker: ``python -m trio_failover.service.workers FD FD FD FD FD FD INDEX``.

    The descriptors: the settings, the lifeline, the ready pipe, the client
    socket, the admin socket and the roster pipe (-1 for none: only the
    first worker has the last two).
    """
    settings_fd, lifeline_fd, ready_fd, client_fd, admin_fd, roster_fd, index = map(int, argv[1:8])
    supervisor_gone = threading.Event()
    threading.Thread(
        target=_watch_lifeline, args=(lifeline_fd, supervisor_gone), daemon=True
    ).start()
    roster = None
    if roster_fd >= 0:  # the supervisor's list of workers, for /status
        roster = Roster()
        install(roster)
        threading.Thread(target=roster.follow, args=(roster_fd,), daemon=True).start()
    metrics_dir = os.environ.get(METRICS_DIR)
    if metrics_dir is not None:  # the supervisor's directory: /metrics adds up every worker
        share_in(metrics_dir)
    program, load = _read_settings(settings_fd)
    os.close(settings_fd)
    client = socket.socket(fileno=client_fd)
    admin = socket.socket(fileno=admin_fd) if admin_fd >= 0 else None
    config = worker_config(program, index)
    loader = None
    if load is not None:
        loader = _WorkerLoader(load, program, index)
        config = _current_settings(loader, config)

    def served(_: BoundAddresses) -> None:
        os.write(ready_fd, READY)
        os.close(ready_fd)

    sockets = InheritedSockets(
        client=client, admin=admin, admin_until=_admin_until(roster) if admin else None
    )
    try:
        return run_server(config, loader=loader, sockets=sockets, on_listening=served)
    finally:
        if supervisor_gone.is_set() and metrics_dir is not None:
            # Nobody else will remove it. A worker still draining keeps its
            # files open and mapped: removing their names harms none of it.
            shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
