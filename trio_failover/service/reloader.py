"""What sets a served proxy's reload off, and the parts of it outside the proxy.

``Reloader.reload`` reads the settings again through the loader the
command line gave (``cli/loader.py``: the same flags, the environment and
the config file, with the same checks as at startup), builds the
listener's TLS context when its files changed, and hands the new
``Config`` to ``Proxy.reload``. A file that does not pass the checks
changes nothing: its error lines are logged as ``serve`` prints them at
startup, and a ``reload`` event says ``ok: false``.

Two triggers: ``SIGHUP`` (``server.py``'s signal watcher sends on the
channel ``run`` reads) and, with ``--watch-config``, ``watch_file``, which
polls the config file's status once a second. Polling rather than the
``watchfiles`` package: no new dependency (it is not installed here and
brings a compiled extension and anyio), virtual time in tests, and the
path is looked at anew each time, so a file replaced by a rename (editors,
a Kubernetes ConfigMap's symlink swap) is seen as well as one written in
place. A change of size, modification time or inode counts; a second's
delay is nothing for a configuration.
"""

from __future__ import annotations

import hashlib
import os
import ssl
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from ..core.config import Config
from ..core.errors import ConfigError, ConfigErrors
from ..proxy.proxy import Proxy
from ..proxy.reload import ReloadResult, failed_reload
from ..telemetry.logs import logger

__all__ = ["ListenerTLS", "Reloader", "tls_digest"]

WATCH_INTERVAL = 1.0
"""Seconds between two looks at the config file (``--watch-config``)."""


class Loader(Protocol):
    """Reads the settings again (``cli/loader.py``'s ``SettingsLoader``)."""

    @property
    def path(self) -> str | None:
        """The config file to watch (``--watch-config``), if any."""

    def __call__(self) -> Config:
        """The settings now; raises ``ConfigError`` (or ``ConfigErrors``)."""
        ...


ContextMaker = Callable[[Config], "ssl.SSLContext | None"]


def placed(loader: Loader | None, error: ConfigError) -> ConfigError:
    """``error`` (serving's, naming only its flag) naming where the value was set.

    The command line's loader knows each value's source (``SettingsLoader.placed``);
    an embedder's loader, any callable with a ``path``, need not: then ``error`` as it is.
    """
    place = getattr(loader, "placed", None)
    return place(error) if place is not None else error


@attrs.define
class ListenerTLS:
    """The client listener's TLS context, read at each new handshake; a reload swaps it."""

    context: ssl.SSLContext | None
    digest: str | None = None
    """``tls_digest`` of the files the context was loaded from."""


def tls_digest(config: Config) -> str | None:
    """A digest of the listener's certificate and key files (None: no TLS, or unreadable)."""
    if config.tls_cert is None:
        return None
    digest = hashlib.sha256()
    try:
        for path in (config.tls_cert, config.tls_key or config.tls_cert):
            with open(path, "rb") as file:
                digest.update(file.read())
    except OSError:
        return None
    return digest.hexdigest()


def error_lines(exc: ConfigError) -> list[str]:
    """The lines ``serve`` prints for a bad setting at startup, one per mistake."""
    errors = exc.errors if isinstance(exc, ConfigErrors) else (exc,)
    return ["trio-failover: error: " + " ".join(str(error).splitlines()) for error in errors]


class Reloader:
    """Reloads ``proxy`` from ``load`` (see the module docstring)."""

    def __init__(
        self, proxy: Proxy, load: Loader, tls: ListenerTLS, make_context: ContextMaker
    ) -> None:
        self.proxy = proxy
        self.load = load
        self.tls = tls
        self._make_context = make_context
        # The file as the last reload read it: what ``watch_file`` compares
        # with, so that a file a SIGHUP reloaded is not reloaded again.
        self._seen: tuple[int, int, int] | None = None

    async def reload(self, *, dry_run: bool = False) -> ReloadResult:
        """Read the settings again and apply them; ``dry_run``: only say what would change."""
        path = self.load.path
        if path is not None and not dry_run:
            self._seen = _file_state(path)
        try:
            new = self.load()
            digest = tls_digest(new)
            running = self.proxy.config
            same_files = (new.tls_cert, new.tls_key) == (running.tls_cert, running.tls_key)
            tls_changed = new.tls_cert is not None and not (
                same_files and digest == self.tls.digest
            )
            context = self._make_context(new) if tls_changed else self.tls.context
        except ConfigError as exc:
            lines = error_lines(exc)
            if dry_run:
                return ReloadResult(False, (), " ".join(lines))
            for line in lines:
                logger.error(line)
            return failed_reload(self.proxy, " ".join(lines), logged=len(lines))
        result = await self.proxy.reload(new, tls_files_changed=tls_changed, dry_run=dry_run)
        if result.ok and not dry_run:
            self.tls.context, self.tls.digest = context, digest
        return result

    async def run(self, requests: trio.abc.ReceiveChannel[None]) -> None:
        """Reload once per message on ``requests`` (a ``SIGHUP`` each), until it closes."""
        async for _ in requests:
            await self.reload()

    async def watch_file(self, path: str, interval: float = WATCH_INTERVAL) -> None:
        """Reload whenever the file at ``path`` changes; runs until cancelled."""
        self._seen = _file_state(path)
        while True:
            await trio.sleep(interval)
            now = _file_state(path)
            if now is None:  # gone for a moment (a rename under way): look again
                self._seen = None
                continue
            if now != self._seen:
                logger.info("config file changed", extra={"fields": {"path": path}})
                await self.reload()


def _file_state(path: str) -> tuple[int, int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return (status.st_mtime_ns, status.st_size, status.st_ino)
