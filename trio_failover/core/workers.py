"""Pure: the decisions of ``--workers N``: each worker's settings, and restarts.

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


def worker_config(config: Config, index: int) -> Config:
    """The settings of worker ``index`` (0 is the first).

    Args:
        config: the program's settings.
        index: the worker's place, 0 to ``workers - 1``.

    Returns:
        ``config`` with the admin listener the first worker's only. The
        listener addresses stay as written (the supervisor bound them and
        hands the sockets over): what ``GET /config`` of the first worker
        answers is the program's settings, so ``check --admin`` compares
        them with the file's like with like. ``workers`` is kept: a worker
        knows it is one of many.
    """
    return config if index == 0 else attrs.evolve(config, admin_listen=None)


def worker_reload_config(program: Config, new: Config, index: int) -> Config:
    """The settings read again for a reload of worker ``index``, as ``worker_config`` gives them.

    Args:
        program: the settings the supervisor started with (the listener
            addresses as the file or flags wrote them).
        new: the settings read again.
        index: the worker's place.

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
    return worker_config(new, index)


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
