"""Serve from a fresh process image, without the command line's imports.

Parsing the command line imports typer, and typer imports pydantic: about
7 MiB of resident memory that a long-running proxy never uses again, and
Python cannot unload a module. So once ``trio-failover serve`` has resolved
and checked its settings, it replaces its own process image with
``python -m trio_failover.cli.reexec`` (``os.execv``: the same process id,
standard streams, environment and parent), which reads the ``Config`` back
and runs ``server.run_server``.

The ``Config``, with the ``SettingsLoader`` that reads the settings again
on a reload (the flags as given), travels in an anonymous in-memory file
(``memfd``) that the new image inherits as a file descriptor: no temporary file, and no copy of
the node credentials in the environment or on the command line, where other
users could read them. The original arguments follow ``--`` on the new
command line, so that ``ps`` still shows what was asked for.

Where there is no ``memfd`` (outside Linux), where the new image would not
import this same copy of the package (a zipapp, or a source checkout run
with ``python -m`` from its folder while another copy is installed), or
where ``exec`` fails, the proxy runs in the command's own process, as an
embedder's ``run_server`` call does.
"""

from __future__ import annotations

import importlib.machinery
import os
import pickle
import sys

from ..core.config import Config
from .loader import SettingsLoader

__all__ = ["exec_serve", "main"]


def _new_image_imports_this_package() -> bool:
    """Whether ``python -P -m trio_failover.cli.reexec`` would import this very package.

    The new image's path is this one's without its first entry (the script's
    folder, or the current directory for ``-m``, which ``-P`` leaves out).
    """
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    top = (__package__ or "trio_failover").partition(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top, sys.path[1:])
    locations = spec.submodule_search_locations if spec is not None else None
    return bool(locations) and any(os.path.abspath(place) == here for place in locations or [])


def exec_serve(config: Config, argv: list[str], loader: SettingsLoader | None = None) -> None:
    """Replace this process with one that serves ``config``; return only if that cannot be done."""
    if not hasattr(os, "memfd_create") or not _new_image_imports_this_package():
        return
    try:
        fd = os.memfd_create("trio-failover-config", 0)
    except OSError:
        return
    try:
        with os.fdopen(os.dup(fd), "wb") as file:
            pickle.dump((config, loader), file)
        os.lseek(fd, 0, os.SEEK_SET)
        os.set_inheritable(fd, True)
        sys.stdout.flush()
        sys.stderr.flush()
        # -P: the current directory does not go on sys.path, so a file named
        # like a module there (trio.py, say) cannot shadow one.
        os.execv(sys.executable, [sys.executable, "-P", "-m", __name__, str(fd), "--", *argv])
    except OSError:
        os.close(fd)


def main(argv: list[str]) -> int:
    """The new image: ``python -m trio_failover.cli.reexec FD -- ORIGINAL-ARGUMENTS``."""
    with os.fdopen(int(argv[1]), "rb") as file:
        config, loader = pickle.load(file)  # written by our own image, just before the exec
    if not isinstance(config, Config):
        raise TypeError(f"expected a Config, read {type(config).__name__}")
    if config.workers > 1:
        from ..service.workers import run_workers

        return run_workers(config, loader)
    from ..service.server import run_server

    return run_server(config, loader=loader)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
