"""Socket options: fast writes everywhere, dead-peer detection on upstream sockets.

A node that dies or restarts mid-request can leave an established TCP
connection that carries nothing: no bytes, no FIN, no RST. A deadline on the
response head cannot tell that node apart from one doing a ten-minute silent
prefill. The kernel can: TCP keepalive probes are answered by a live peer's
TCP stack whatever its application is doing, and go unanswered when the peer
is gone. ``TCP_USER_TIMEOUT`` covers the other half, data we sent that is
never acknowledged. Either way Linux fails the next ``recv``/``send`` with
``ETIMEDOUT``, which ``is_dead_peer_error`` recognises.

``keepalive_plan`` is pure arithmetic; ``apply_*`` only call ``setsockopt``.
Options the platform does not have (macOS spells the idle option
``TCP_KEEPALIVE`` and has no ``TCP_USER_TIMEOUT``) are skipped, and each is
reported once per process with a warning on the ``trio_failover.sockopts``
logger.
"""

from __future__ import annotations

import errno
import logging
import math
import socket

import attrs
import trio

__all__ = [
    "KeepalivePlan",
    "apply_client_options",
    "apply_upstream_options",
    "is_dead_peer_error",
    "keepalive_plan",
]

logger = logging.getLogger("trio_failover.sockopts")

# Linux bounds (include/net/tcp.h: MAX_TCP_KEEPIDLE, MAX_TCP_KEEPINTVL,
# MAX_TCP_KEEPCNT); a larger value makes setsockopt fail with EINVAL.
MAX_KEEPIDLE = 32767
MAX_KEEPINTVL = 32767
MAX_KEEPCNT = 127
# TCP_USER_TIMEOUT is an int of milliseconds.
MAX_USER_TIMEOUT_MS = 2**31 - 1

# How many unanswered probes it takes. Three rides out a lost probe or two on
# a busy network while leaving each interval a useful share of the budget.
PROBES = 3
# The smallest whole-second plan: one second idle, one probe, one second to
# answer it.
MIN_BUDGET = 2
# With PROBES intervals of at most MAX_KEEPINTVL and an idle of about the same
# size, this is the largest budget every option can still express.
MAX_BUDGET = (PROBES + 1) * MAX_KEEPINTVL


@attrs.frozen
class KeepalivePlan:
    """Keepalive settings that declare a silent peer dead within a budget.

    Attributes:
        idle: seconds of silence before the first probe (``TCP_KEEPIDLE``).
        interval: seconds between probes (``TCP_KEEPINTVL``).
        count: unanswered probes before the peer is dead (``TCP_KEEPCNT``).
        user_timeout_ms: how long sent data may stay unacknowledged, and, on
            Linux, how long a probed peer may stay silent (``TCP_USER_TIMEOUT``).
    """

    idle: int
    interval: int
    count: int
    user_timeout_ms: int

    @property
    def total(self) -> int:
        """Seconds from the last byte heard to the peer being declared dead."""
        return self.idle + self.interval * self.count


def keepalive_plan(dead_peer_timeout: float) -> KeepalivePlan | None:
    """Derive keepalive settings from ``--dead-peer-timeout``.

    A peer that falls silent right after its last segment is declared dead
    ``idle + interval * count`` seconds later: the first probe goes out after
    ``idle``, one more every ``interval``, and one ``interval`` after the
    last unanswered probe the connection is failed. The kernel takes whole
    seconds, so the plan fills the whole-second budget
    ``B = floor(dead_peer_timeout)`` exactly:

    - ``interval = max(1, B // (PROBES + 1))``: probes share the budget
      evenly with the idle time;
    - ``count = min(PROBES, (B - 1) // interval)``: fewer probes when the
      budget is too small for three and an idle of at least one second;
    - ``idle = B - count * interval`` (>= 1, and at least ``interval``).

    For 30 s that is idle 9, interval 7, count 3; for 3 s idle 1, interval 1,
    count 2; for 2 s idle 1, interval 1, count 1. Below 2 s no whole-second
    plan fits, so the 2-second plan is used. Near and above ``MAX_BUDGET``
    (about 36 h) the options' own limits cap the plan, a few seconds short.

    ``user_timeout_ms`` is the plan's total (or the timeout itself when that
    is shorter, below 2 s). Linux uses it twice: unacknowledged data fails
    after it, and once ``TCP_USER_TIMEOUT`` is set the keepalive timer drops
    a probed peer when this much time has passed since it was last heard,
    instead of counting probes. Making it equal to the total keeps both
    rules on the same instant: the timer fires at ``idle + k * interval``,
    and at ``k = count`` exactly ``total`` seconds have passed.

    Args:
        dead_peer_timeout: seconds; ``0`` turns detection off.

    Returns:
        The settings, or ``None`` for ``0``.

    Raises:
        ValueError: the timeout is negative or not finite.
    """
    if not math.isfinite(dead_peer_timeout) or dead_peer_timeout < 0:
        raise ValueError(f"dead_peer_timeout must be a finite number >= 0, not {dead_peer_timeout}")
    if dead_peer_timeout == 0:
        return None
    budget = min(MAX_BUDGET, max(MIN_BUDGET, math.floor(dead_peer_timeout)))
    interval = max(1, budget // (PROBES + 1))
    count = min(PROBES, (budget - 1) // interval)
    idle = min(MAX_KEEPIDLE, budget - count * interval)
    total = idle + count * interval
    user_timeout_ms = round(min(float(total), dead_peer_timeout) * 1000)
    return KeepalivePlan(
        idle=idle,
        interval=interval,
        count=count,
        user_timeout_ms=max(1, min(MAX_USER_TIMEOUT_MS, user_timeout_ms)),
    )


# Options already reported as unavailable; each is reported once per process.
_reported: set[str] = set()


def _report_once(problems: dict[str, str]) -> None:
    # problems: option name -> why it could not be set.
    fresh = {name: why for name, why in problems.items() if name not in _reported}
    if not fresh:
        return
    _reported.update(fresh)
    logger.warning(
        "could not set %s on upstream sockets; dead-peer detection may take longer "
        "than --dead-peer-timeout here",
        ", ".join(f"{name} ({why})" for name, why in fresh.items()),
    )


def _tcp_option(*names: str) -> tuple[str, int] | None:
    # Looked up on each call, not at import, so that tests can take options
    # away (monkeypatch) to play a platform that lacks them.
    for name in names:
        value = getattr(socket, name, None)
        if isinstance(value, int):
            return name, value
    return None


def apply_client_options(sock: trio.socket.SocketType) -> None:
    """Set ``TCP_NODELAY`` on an accepted client socket.

    Streamed tokens are small writes; Nagle's algorithm would hold each one
    back until the previous one is acknowledged.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def apply_upstream_options(sock: trio.socket.SocketType, dead_peer_timeout: float) -> None:
    """Prepare a freshly connected upstream socket.

    Sets ``TCP_NODELAY``, and unless ``dead_peer_timeout`` is ``0``,
    ``SO_KEEPALIVE`` with the idle, interval and count of
    ``keepalive_plan(dead_peer_timeout)`` plus ``TCP_USER_TIMEOUT``. Options
    the platform lacks, or whose ``setsockopt`` fails, are skipped and
    logged once per process; the socket is still usable.

    Args:
        sock: a connected TCP socket (``trio.SocketStream.socket``).
        dead_peer_timeout: seconds, ``0`` for off.

    Raises:
        OSError: ``TCP_NODELAY`` or ``SO_KEEPALIVE`` could not be set, which
            means the socket is not a TCP socket at all.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    plan = keepalive_plan(dead_peer_timeout)
    if plan is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    wanted: list[tuple[tuple[str, ...], int]] = [
        # macOS names the idle time TCP_KEEPALIVE; Linux and Windows TCP_KEEPIDLE.
        (("TCP_KEEPIDLE", "TCP_KEEPALIVE"), plan.idle),
        (("TCP_KEEPINTVL",), plan.interval),
        (("TCP_KEEPCNT",), plan.count),
        (("TCP_USER_TIMEOUT",), plan.user_timeout_ms),
    ]
    problems: dict[str, str] = {}
    for names, value in wanted:
        option = _tcp_option(*names)
        if option is None:
            problems[names[0]] = "not available on this platform"
            continue
        name, number = option
        try:
            sock.setsockopt(socket.IPPROTO_TCP, number, value)
        except OSError as exc:
            problems[name] = f"refused for {value}: {exc.strerror or exc}"
    if problems:
        _report_once(problems)


# Windows sockets report WSAETIMEDOUT, which Python does not fold into ETIMEDOUT.
_TIMED_OUT = frozenset(
    code for code in (errno.ETIMEDOUT, getattr(errno, "WSAETIMEDOUT", None)) if code is not None
)


def is_dead_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the kernel giving up on a silent peer.

    Linux reports an expired keepalive or ``TCP_USER_TIMEOUT`` as ``ETIMEDOUT``
    on the next ``recv``/``send``; Trio wraps that ``OSError`` in
    ``trio.BrokenResourceError``. The exception itself, its ``__cause__`` and
    ``__context__`` chain, and the members of exception groups are searched.

    A failed ``connect`` can carry ``ETIMEDOUT`` too (unanswered SYNs); ask
    this only about errors after the connection was established.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _TIMED_OUT:
            return True
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
    return False
