"""Socket options of upstream and client sockets, read back from the kernel."""

from __future__ import annotations

import errno
import logging
import math
import socket
import sys
from collections.abc import AsyncIterator

import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from trio_failover.wire import sockopts
from trio_failover.wire.sockopts import (
    KeepalivePlan,
    apply_client_options,
    apply_upstream_options,
    is_dead_peer_error,
    keepalive_plan,
)
from trio_failover.wire.upstream import open_tcp

linux_only = pytest.mark.skipif(
    sys.platform != "linux", reason="reads back Linux-only TCP options (TCP_USER_TIMEOUT)"
)

# --- the plan: pure arithmetic -------------------------------------------------------------

PLAN_CASES = [
    # timeout, idle, interval, count, user_timeout_ms
    (30.0, 9, 7, 3, 30_000),
    (3.0, 1, 1, 2, 3_000),
    (2.0, 1, 1, 1, 2_000),
    (2.5, 1, 1, 1, 2_000),  # whole seconds only: the budget is floor(2.5) = 2
    (0.5, 1, 1, 1, 500),  # below 2 s: the smallest plan, data still fails after 0.5 s
    (5.0, 2, 1, 3, 5_000),
    (10.0, 4, 2, 3, 10_000),
    (120.0, 30, 30, 3, 120_000),
    (1e9, 32767, 32767, 3, 131_068_000),  # capped at what the kernel accepts
]


@pytest.mark.parametrize(("timeout", "idle", "interval", "count", "user_ms"), PLAN_CASES)
def test_keepalive_plan_table(
    timeout: float, idle: int, interval: int, count: int, user_ms: int
) -> None:
    assert keepalive_plan(timeout) == KeepalivePlan(idle, interval, count, user_ms)


def test_keepalive_plan_zero_is_off() -> None:
    assert keepalive_plan(0) is None
    assert keepalive_plan(0.0) is None


@pytest.mark.parametrize("bad", [-1.0, -0.001, math.inf, math.nan])
def test_keepalive_plan_rejects_nonsense(bad: float) -> None:
    with pytest.raises(ValueError, match="dead_peer_timeout"):
        keepalive_plan(bad)


@given(st.floats(min_value=2.0, max_value=float(sockopts.MAX_BUDGET)))
@example(2.0)
@example(131_066.0)  # once gave an idle over the kernel's limit
@example(float(sockopts.MAX_BUDGET))
def test_keepalive_plan_fits_the_budget(timeout: float) -> None:
    plan = keepalive_plan(timeout)
    assert plan is not None
    # Dead within the timeout, using all of its whole seconds (but for the last
    # few, where the kernel's limits on each option bite).
    assert math.floor(timeout) - 3 <= plan.total <= timeout
    if timeout < sockopts.MAX_BUDGET - 3:
        assert plan.total == math.floor(timeout)
    assert plan.user_timeout_ms == plan.total * 1000
    assert 1 <= plan.idle <= sockopts.MAX_KEEPIDLE
    assert 1 <= plan.interval <= sockopts.MAX_KEEPINTVL
    assert 1 <= plan.count <= sockopts.PROBES
    # The first probe never comes sooner than the gap between probes.
    assert plan.idle >= plan.interval


# --- real sockets on loopback ------------------------------------------------------------


@pytest.fixture
async def tcp_pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """A connected client stream and the server side's accepted stream."""
    with trio.fail_after(5):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        listener = listeners[0]
        port = listener.socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        accepted = await listener.accept()
    try:
        yield client, accepted
    finally:
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(accepted)
        await trio.aclose_forcefully(listener)


def _tcp(sock: trio.socket.SocketType, option: int) -> int:
    return int(sock.getsockopt(socket.IPPROTO_TCP, option))


def _keepalive_on(sock: trio.socket.SocketType) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))


@linux_only
@pytest.mark.parametrize(
    ("dead_peer_timeout", "idle", "interval", "count", "user_ms"),
    [
        (30.0, 9, 7, 3, 30_000),
        (3.0, 1, 1, 2, 3_000),
        (2.0, 1, 1, 1, 2_000),
    ],
)
async def test_upstream_options_read_back(
    tcp_pair: tuple[trio.SocketStream, trio.SocketStream],
    dead_peer_timeout: float,
    idle: int,
    interval: int,
    count: int,
    user_ms: int,
) -> None:
    sock = tcp_pair[0].socket
    assert not _keepalive_on(sock)  # the kernel default, so the check below means something
    apply_upstream_options(sock, dead_peer_timeout)
    assert _keepalive_on(sock)
    assert _tcp(sock, socket.TCP_NODELAY)
    assert _tcp(sock, socket.TCP_KEEPIDLE) == idle
    assert _tcp(sock, socket.TCP_KEEPINTVL) == interval
    assert _tcp(sock, socket.TCP_KEEPCNT) == count
    assert _tcp(sock, socket.TCP_USER_TIMEOUT) == user_ms


@linux_only
async def test_zero_leaves_keepalive_off(
    tcp_pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    sock = tcp_pair[0].socket
    apply_upstream_options(sock, 0)
    assert _tcp(sock, socket.TCP_NODELAY)
    assert not _keepalive_on(sock)
    assert _tcp(sock, socket.TCP_USER_TIMEOUT) == 0


async def test_client_options_set_nodelay(
    tcp_pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    sock = tcp_pair[1].socket
    # Trio's SocketStream already turns Nagle off; clear it to see ours set it.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
    apply_client_options(sock)
    assert _tcp(sock, socket.TCP_NODELAY)
    assert not _keepalive_on(sock)


@pytest.fixture
def fresh_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which options were reported, for this test only."""
    monkeypatch.setattr(sockopts, "_reported", set())


@linux_only
@pytest.mark.usefixtures("fresh_reports")
async def test_macos_like_platform_uses_what_exists_and_warns_once(
    tcp_pair: tuple[trio.SocketStream, trio.SocketStream],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # macOS spells the idle option TCP_KEEPALIVE and has no TCP_USER_TIMEOUT.
    # Play that on Linux: TCP_KEEPALIVE gets Linux's TCP_KEEPIDLE number, so
    # reading TCP_KEEPIDLE back shows the fallback name was used.
    keepidle = socket.TCP_KEEPIDLE
    monkeypatch.delattr(socket, "TCP_KEEPIDLE")
    monkeypatch.delattr(socket, "TCP_USER_TIMEOUT")
    monkeypatch.setattr(socket, "TCP_KEEPALIVE", keepidle, raising=False)
    caplog.set_level(logging.WARNING, logger="trio_failover.sockopts")
    client, accepted = tcp_pair

    apply_upstream_options(client.socket, 30.0)
    apply_upstream_options(accepted.socket, 30.0)

    for sock in (client.socket, accepted.socket):
        assert _keepalive_on(sock)
        assert _tcp(sock, keepidle) == 9
        assert _tcp(sock, socket.TCP_KEEPINTVL) == 7
        assert _tcp(sock, socket.TCP_KEEPCNT) == 3
        assert _tcp(sock, 18) == 0  # TCP_USER_TIMEOUT's number on Linux: left alone
    warnings = [r for r in caplog.records if r.name == "trio_failover.sockopts"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert "TCP_USER_TIMEOUT" in warnings[0].getMessage()
    assert "TCP_KEEPIDLE" not in warnings[0].getMessage()


@pytest.mark.usefixtures("fresh_reports")
async def test_refused_option_is_skipped_and_reported_once(
    tcp_pair: tuple[trio.SocketStream, trio.SocketStream],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An option number the kernel does not know: setsockopt fails (ENOPROTOOPT).
    monkeypatch.setattr(socket, "TCP_KEEPCNT", 9999)
    caplog.set_level(logging.WARNING, logger="trio_failover.sockopts")
    client, accepted = tcp_pair

    apply_upstream_options(client.socket, 3.0)
    apply_upstream_options(accepted.socket, 3.0)

    assert _keepalive_on(client.socket)
    warnings = [r for r in caplog.records if r.name == "trio_failover.sockopts"]
    assert len(warnings) == 1
    assert "TCP_KEEPCNT" in warnings[0].getMessage()


# --- recognising the kernel's verdict -----------------------------------------------------


def _chained(inner: Exception, outer: Exception, *, explicit: bool) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            if explicit:
                raise outer from exc
            raise outer  # noqa: B904 - implicit chaining (__context__) is the case under test
    except Exception as caught:
        return caught


def _cycle() -> BaseException:
    a = ValueError("a")
    b = ValueError("b")
    a.__context__ = b
    b.__context__ = a
    return a


timed_out = OSError(errno.ETIMEDOUT, "Connection timed out")

DEAD_PEER_CASES = [
    ("bare ETIMEDOUT", timed_out, True),
    ("TimeoutError from errno", OSError(errno.ETIMEDOUT, "x"), True),
    (
        "trio wraps it (raise from)",
        _chained(timed_out, trio.BrokenResourceError("socket connection broken"), explicit=True),
        True,
    ),
    (
        "raised while handling it",
        _chained(timed_out, RuntimeError("mapped later"), explicit=False),
        True,
    ),
    (
        "inside an exception group",
        ExceptionGroup("attempt", [ValueError("other"), trio.BrokenResourceError()]),
        False,
    ),
    (
        "ETIMEDOUT inside an exception group",
        ExceptionGroup(
            "attempt",
            [_chained(timed_out, trio.BrokenResourceError(), explicit=True)],
        ),
        True,
    ),
    ("reset by peer", ConnectionResetError(errno.ECONNRESET, "reset"), False),
    (
        "broken by reset",
        _chained(
            ConnectionResetError(errno.ECONNRESET, "reset"),
            trio.BrokenResourceError(),
            explicit=True,
        ),
        False,
    ),
    ("a Trio deadline is not a dead peer", trio.TooSlowError(), False),
    ("TimeoutError without errno", TimeoutError(), False),
    ("unrelated", ValueError("x"), False),
    ("a cycle of contexts ends", _cycle(), False),
]


@pytest.mark.parametrize(
    ("exc", "expected"),
    [pytest.param(exc, expected, id=name) for name, exc, expected in DEAD_PEER_CASES],
)
def test_is_dead_peer_error(exc: BaseException, expected: bool) -> None:
    assert is_dead_peer_error(exc) is expected


# --- connecting to nodes -------------------------------------------------------------------


async def _listener(host: str) -> trio.SocketListener:
    (listener,) = await trio.open_tcp_listeners(0, host=host)
    return listener


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_open_tcp_reaches_an_address_or_a_name(host: str) -> None:
    listener = await _listener("127.0.0.1")
    port = listener.socket.getsockname()[1]
    stream = await open_tcp(host, port)
    accepted = await listener.accept()
    try:
        await stream.send_all(b"ping")
        assert await accepted.receive_some(4) == b"ping"
        assert _tcp(stream.socket, socket.TCP_NODELAY)
    finally:
        for resource in (stream, accepted, listener):
            await trio.aclose_forcefully(resource)


async def test_open_tcp_over_ipv6_when_the_machine_has_it() -> None:
    try:
        listener = await _listener("::1")
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    port = listener.socket.getsockname()[1]
    stream = await open_tcp("::1", port)
    try:
        assert stream.socket.family == socket.AF_INET6
    finally:
        await trio.aclose_forcefully(stream)
        await trio.aclose_forcefully(listener)


async def test_open_tcp_refused_keeps_the_errno_and_names_the_address() -> None:
    listener = await _listener("127.0.0.1")
    port = listener.socket.getsockname()[1]
    await trio.aclose_forcefully(listener)  # nothing listens there now
    with pytest.raises(OSError, match=f"cannot connect to 127.0.0.1:{port}") as caught:
        await open_tcp("127.0.0.1", port)
    assert caught.value.errno == errno.ECONNREFUSED
