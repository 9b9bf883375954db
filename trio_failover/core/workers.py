"""Pure: the decisions of ``--workers N`` (SPEC 8): each worker's settings, and restarts.

The supervisor (``service/workers.py``) binds the listeners once and hands
them to its workers; these functions say what each worker is told and how
long to wait before a dead one is started again.
"""

from __future__ import annotations

import attrs

from .config import Config
from .errors import ConfigError

__all__ = [
    "RESTART_FIRST",
    "RESTART_MOST",
    "STEADY_AFTER",
    "restart_delay",
    "worker_config",
    "worker_reload_config",
]

RESTART_FIRST = 0.1
RESTART_MOST = 10.0
# A worker that ran this long before it died counts as a fresh failure,
# not as one more of a crash loop: its restart is not delayed.
STEADY_AFTER = 30.0


def worker_config(config: Config, index: int, listen: str, admin_listen: str | None) -> Config:
    """The settings of worker ``index`` (0 is the first).

    Args:
        config: the program's settings.
        index: the worker's place, 0 to ``workers - 1``.
        listen: the client listener as bound by the supervisor (its real
            port, when 0 was asked), so that every worker says the same.
        admin_listen: the admin listener as bound, or None when off.

    Returns:
        ``config`` with those addresses; the admin listener is the first
        worker's only. ``workers`` is kept: a worker knows it is one of many.
    """
    return attrs.evolve(config, listen=listen, admin_listen=admin_listen if index == 0 else None)


def worker_reload_config(
    program: Config, new: Config, index: int, listen: str, admin_listen: str | None
) -> Config:
    """The settings read again for a reload of worker ``index``, as ``worker_config`` gives them.

    Args:
        program: the settings the supervisor started with (the listener
            addresses as the file or flags wrote them).
        new: the settings read again.
        index, listen, admin_listen: as for ``worker_config``.

    Returns:
        ``new`` with the bound addresses of this worker, so that a reload
        compares like with like.

    Raises:
        ConfigError: ``new`` names other listener addresses than ``program``:
            the supervisor bound them, a restart of the program is needed.
            Raised for every worker alike (the first one alone has the admin
            listener, but none of them may apply the rest of that reload).
    """
    for option in ("listen", "admin_listen"):
        before, after = getattr(program, option), getattr(new, option)
        if before != after:
            raise ConfigError(
                option.replace("_", "-"),
                after,
                f"was {before}; the supervisor bound the listeners, a change needs a restart",
            )
    return worker_config(new, index, listen, admin_listen)


def restart_delay(failures: int, lived: float) -> float:
    """Seconds before a worker that died is started again.

    Args:
        failures: how many times in a row it died (this death included).
        lived: seconds it ran before this death.

    Returns:
        ``RESTART_FIRST`` doubled with each failure in a row, at most
        ``RESTART_MOST``; ``RESTART_FIRST`` after a worker that had run for
        ``STEADY_AFTER`` seconds (a crash now and then is not a loop).
    """
    if lived >= STEADY_AFTER or failures <= 1:
        return RESTART_FIRST
    return min(RESTART_MOST, RESTART_FIRST * 2.0 ** min(failures - 1, 32))
