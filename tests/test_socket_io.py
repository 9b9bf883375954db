"""The socket reads and writes of wire.http1 over loopback: the results and errors of Trio's."""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from trio_failover.wire import http1


@pytest.fixture
async def pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """A connected pair of plain TCP streams on 127.0.0.1: (ours, peer)."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    ours = await trio.open_tcp_stream("127.0.0.1", port)
    peer = await listener.accept()
    assert isinstance(peer, trio.SocketStream)
    yield ours, peer
    for stream in (ours, peer, listener):
        await trio.aclose_forcefully(stream)


def reset_on_close(stream: trio.SocketStream) -> None:
    """SO_LINGER on with a zero timeout: close() sends an RST, not a FIN."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def receive_into(got: list[bytes | Exception], stream: trio.SocketStream) -> None:
    """One ``http1.receive``, its bytes or its Trio error appended to ``got``."""
    try:
        got.append(await http1.receive(stream))
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        got.append(exc)


async def test_receive_waits_for_the_bytes_then_reads_them(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, peer = pair
    got: list[bytes | Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_into, got, ours)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # nothing sent yet: it waits, it does not return empty
        await peer.send_all(b"data: 1\n\n")
    assert got == [b"data: 1\n\n"]


async def test_receive_returns_empty_at_eof(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, peer = pair
    await peer.send_all(b"last")
    await peer.send_eof()
    assert await http1.receive(ours) == b"last"
    assert await http1.receive(ours) == b""


async def test_a_reset_is_a_broken_resource_with_the_os_error_as_its_cause(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, peer = pair
    reset_on_close(peer)
    await peer.aclose()
    with pytest.raises(trio.BrokenResourceError) as caught:
        await http1.receive(ours)
    assert isinstance(caught.value.__cause__, ConnectionResetError)


async def test_a_close_by_another_task_ends_the_wait(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, _ = pair
    got: list[bytes | Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_into, got, ours)
        await trio.testing.wait_all_tasks_blocked()
        await ours.aclose()
    assert len(got) == 1
    assert isinstance(got[0], trio.ClosedResourceError)
    with pytest.raises(trio.ClosedResourceError):
        await http1.receive(ours)  # and once closed, before any wait


async def test_receive_is_cancellable(pair: tuple[trio.SocketStream, trio.SocketStream]) -> None:
    ours, peer = pair
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(http1.receive, ours)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    await peer.send_all(b"after")  # the stream still works after a cancelled wait
    assert await http1.receive(ours) == b"after"


async def test_send_delivers_everything_also_beyond_the_socket_buffers(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, peer = pair
    small, large = b"x" * 100, bytes(range(256)) * 40_000  # 10 MB: many partial writes
    received = bytearray()

    async def read_all() -> None:
        while len(received) < len(small) + len(large):
            data = await peer.receive_some(1 << 16)
            assert data, "EOF before all bytes came"
            received.extend(data)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await http1.send(ours, small)
            await http1.send(ours, large)
    assert bytes(received) == small + large


async def test_send_to_a_reset_peer_is_a_broken_resource(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, peer = pair
    reset_on_close(peer)
    await peer.aclose()
    await trio.testing.wait_all_tasks_blocked()
    with pytest.raises(trio.BrokenResourceError):  # loopback: the RST came already
        await http1.send(ours, b"x" * 1000)


async def test_send_after_send_eof_raises_as_trio_does(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, _ = pair
    await ours.send_eof()
    with pytest.raises(trio.ClosedResourceError):
        await http1.send(ours, b"late")


async def test_other_streams_go_through_their_own_methods() -> None:
    ours, peer = trio.testing.memory_stream_pair()
    await http1.send(ours, b"in memory")
    assert await http1.receive(peer) == b"in memory"
    await ours.aclose()
    assert await http1.receive(peer) == b""


async def test_a_write_the_kernel_takes_whole_is_not_a_checkpoint(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    """What the module is for: per relayed chunk, one pass of the scheduler less."""
    ours, peer = pair
    with trio.CancelScope() as scope:
        scope.cancel()
        await http1.send(ours, b"at once")  # Trio's send_all would raise Cancelled here
    assert not scope.cancelled_caught
    assert await peer.receive_some(100) == b"at once"


async def test_without_posix_sockets_trio_serves(
    pair: tuple[trio.SocketStream, trio.SocketStream], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Windows a socket is no descriptor for os.read: Trio's methods do the work."""
    monkeypatch.setattr(http1, "_POSIX_SOCKETS", False)
    monkeypatch.setattr(http1.os, "read", None)  # would raise if called
    monkeypatch.setattr(http1.os, "write", None)
    ours, peer = pair
    await http1.send(ours, b"ping")
    assert await http1.receive(peer) == b"ping"


async def test_read_now_takes_what_has_arrived_without_waiting(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, peer = pair
    assert http1.read_now(ours) is None  # nothing yet: no wait, no bytes
    await peer.send_all(b"GET / HTTP/1.1\r\n\r\n")
    assert http1.read_now(ours) == b"GET / HTTP/1.1\r\n\r\n"  # a plain call: no checkpoint
    await peer.send_eof()
    assert http1.read_now(ours) == b""
    assert await http1.receive(ours) == b""  # the EOF is still there to be met


async def test_read_now_of_a_reset_is_a_broken_resource(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    ours, peer = pair
    reset_on_close(peer)
    await peer.aclose()
    with pytest.raises(trio.BrokenResourceError) as caught:
        http1.read_now(ours)
    assert isinstance(caught.value.__cause__, ConnectionResetError)


async def test_read_now_reads_nothing_of_other_streams() -> None:
    ours, peer = trio.testing.memory_stream_pair()
    await ours.send_all(b"in memory")
    assert http1.read_now(peer) is None
    assert await http1.receive(peer) == b"in memory"
