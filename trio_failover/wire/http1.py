"""HTTP/1 with h11, and the bytes under it, shared by every side that speaks it: no policy here.

The one receive loop (``next_event``) and the body readers built on it
(``read_body``, ``read_prefix``), the one way to send a batch of events
(``send_events``), and the JSON answer (``json_answer``; the error
documents are ``core.answers'``). The client side (``client.py``), the
node side (``upstream.py``), the admin API and ``testing`` all use these.

Under them, the reads and writes of a socket (``receive``, ``read_now``,
``write_now``, ``send``; the Redis client uses them too), with fewer
system calls and yields than Trio's stream methods. Trio's
``SocketStream.receive_some`` first tries the read and, when nothing has
arrived (nearly always for the proxy: it reads right after it wrote),
takes a ``BlockingIOError`` and then waits. Its ``send_all`` yields to the
scheduler after every complete write. In the relay of a stream both happen
once per chunk, and each costs about as much as the useful work. So on a
plain ``trio.SocketStream`` these functions wait for readability first and
then read once, and write at once without a yield when the kernel takes the
whole buffer. A new client connection is the other way round: its
request has nearly always arrived by the time its task runs, so
``read_now`` reads it without waiting. Any other stream (TLS, in-memory
streams in tests, the admin side) goes through Trio's own methods
unchanged.

Checkpoints: ``receive`` always is one (it waits). ``send`` is one only
when the write did not go through at once; the relay loop's next
``receive`` is its checkpoint. ``read_now`` and ``write_now`` never are.
"""

from __future__ import annotations

import json
import os
import sys
from http import HTTPStatus

import h11
import trio

RECEIVE_SIZE = 65536

Headers = list[tuple[bytes, bytes]]

# -- bytes on a socket ---------------------------------------------------------

# A socket is a file descriptor that os.read and os.write accept on POSIX
# systems; on Windows it is a handle they do not, and Trio's methods serve.
_POSIX_SOCKETS = sys.platform != "win32"


def _plain_fd(stream: object) -> int:
    """The socket's descriptor under a plain, open ``trio.SocketStream``, else -1.

    -1 also for a socket closed or shut down for writing: Trio's methods
    then raise the error they document.
    """
    if (
        _POSIX_SOCKETS
        and type(stream) is trio.SocketStream
        and not stream.socket.did_shutdown_SHUT_WR
    ):
        return stream.socket.fileno()
    return -1


async def receive(stream: trio.abc.ReceiveStream, size: int = RECEIVE_SIZE) -> bytes:
    """Up to ``size`` bytes, b"" at EOF: ``receive_some``, waiting before the read.

    Raises:
        trio.ClosedResourceError: the stream was closed (before or during the wait).
        trio.BrokenResourceError: the read failed (reset, dead peer), with the
            ``OSError`` as its cause, as ``receive_some`` raises it.
    """
    fd = _plain_fd(stream)
    if fd < 0:
        return bytes(await stream.receive_some(size))
    await trio.lowlevel.wait_readable(fd)
    try:
        return os.read(fd, size)
    except BlockingIOError:  # woken, yet nothing to read: Trio's way from here
        return bytes(await stream.receive_some(size))
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


def read_now(stream: trio.abc.ReceiveStream, size: int = RECEIVE_SIZE) -> bytes | None:
    """What the kernel already holds of ``stream``'s input, without waiting.

    Not a checkpoint. b"" at EOF; None when nothing has arrived, or when
    ``stream`` is not a plain, open socket stream (nothing was read).

    Raises:
        trio.BrokenResourceError: the read failed (reset, dead peer), with
            the ``OSError`` as its cause, as ``receive_some`` raises it.
    """
    fd = _plain_fd(stream)
    if fd < 0:
        return None
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


def write_now(stream: trio.abc.SendStream, data: bytes) -> int:
    """Write what the kernel takes of ``data`` at once, without waiting; how much.

    Not a checkpoint. -1 when ``stream`` is not a plain, open socket stream
    (nothing was written: use its ``send_all``).

    Raises:
        trio.BrokenResourceError: the write failed (reset, dead peer), with
            the ``OSError`` as its cause, as ``send_all`` raises it.
    """
    fd = _plain_fd(stream)
    if fd < 0 or not data:
        return -1
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


async def send(stream: trio.abc.SendStream, data: bytes) -> None:
    """Write all of ``data``: at once when the kernel takes it, else ``send_all``.

    Raises:
        trio.BrokenResourceError, trio.ClosedResourceError: as ``send_all``.
    """
    sent = write_now(stream, data)
    if sent < 0:
        await stream.send_all(data)
    elif sent < len(data):
        await stream.send_all(memoryview(data)[sent:])


# -- HTTP/1 with h11 -----------------------------------------------------------


class EarlyClose(Exception):
    """The peer closed the connection before the message was complete."""


async def next_event(
    stream: trio.abc.ReceiveStream,
    conn: h11.Connection,
    *,
    strict_eof: bool = True,
    starved: bool = False,
) -> h11.Event:
    """The next h11 event, receiving from ``stream`` as needed.

    With ``strict_eof``, an EOF that cuts a message short is an
    ``EarlyClose`` (a fast failure of the peer), not a protocol error, though
    h11 reports it as one; without, h11's own view of the EOF is returned.
    ``starved``: h11's last answer was ``NEED_DATA`` and nothing was fed to
    it since, so it is not asked again before a read.

    Raises:
        EarlyClose: the peer closed mid-message (``strict_eof`` only).
        h11.RemoteProtocolError: the peer broke HTTP/1.1.
    """
    while True:
        if starved:
            starved = False
        else:
            event = conn.next_event()
            if event is h11.PAUSED:
                # A server reads one request at a time: bytes of a next one,
                # before this one is answered, end the conversation.
                return h11.ConnectionClosed()
            if event is not h11.NEED_DATA:
                assert not isinstance(event, type)
                return event
        data = await receive(stream, RECEIVE_SIZE)
        conn.receive_data(data)
        if not data and strict_eof:
            return _at_eof(conn)


def _at_eof(conn: h11.Connection) -> h11.Event:
    """The event after an EOF was fed to h11 (strict: one that cuts a message is EarlyClose)."""
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise EarlyClose("connection closed mid-message") from exc
    if event is h11.NEED_DATA or isinstance(event, (h11.ConnectionClosed, type)):
        raise EarlyClose("connection closed")
    assert not isinstance(event, type)
    return event


async def read_body(stream: trio.abc.Stream, conn: h11.Connection) -> tuple[bytes, bool]:
    """The next body bytes (at least one) and whether the body ended with them.

    Returns ``(b"", True)`` at the end of the body. After the first bytes,
    the events h11 can parse from what already arrived are taken too, without
    another read: coalescing them delays nothing, and a small answer that
    came in one segment is then relayed in one write, its end included.
    """
    data, ended, _ = await read_chunk(stream, conn)
    return data, ended


async def read_chunk(
    stream: trio.abc.Stream, conn: h11.Connection, *, starved: bool = False
) -> tuple[bytes, bool, bool]:
    """``read_body``, plus whether h11 was left wanting data (``starved``).

    The relay passes the last call's ``starved`` to the next: h11 is then
    not asked once more, in vain, before the read (one call less per chunk).
    """
    while True:
        event = await next_event(stream, conn, starved=starved)
        starved = False
        if isinstance(event, h11.Data):
            if event.data:
                break
        elif isinstance(event, h11.EndOfMessage):
            return b"", True, False
        else:
            raise EarlyClose("connection closed in the body")
    return gather_data(conn, event.data)  # h11's own copy: relayed as is, not copied again


def gather_data(conn: h11.Connection, data: bytes) -> tuple[bytes, bool, bool]:
    """``data`` joined with the body bytes h11 has parsed after it; ended; starved.

    One read often holds several chunks of a chunked body (or a whole small
    answer): they go on together. ``starved``: h11 was left wanting data.
    """
    parts: list[bytes] | None = None
    ended = starved = False
    try:
        while True:
            more = conn.next_event()
            if isinstance(more, h11.Data):
                if parts is None:
                    parts = [data]
                parts.append(more.data)
            else:
                ended = isinstance(more, h11.EndOfMessage)
                starved = more is h11.NEED_DATA  # nothing more yet
                break
    except h11.RemoteProtocolError:
        pass  # h11 stays in ERROR and raises again on the next read
    return (data if parts is None else b"".join(parts)), ended, starved


async def read_prefix(
    stream: trio.abc.Stream, conn: h11.Connection, limit: int
) -> tuple[bytes, bool]:
    """Up to about ``limit`` body bytes; complete=True when the body ended within them."""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        event = await next_event(stream, conn)
        if isinstance(event, h11.Data):
            parts.append(bytes(event.data))
            size += len(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(parts), True
        else:
            raise EarlyClose("connection closed in the error body")
    return b"".join(parts), False


async def send_events(
    stream: trio.abc.SendStream, conn: h11.Connection, *events: h11.Event
) -> None:
    """Send h11 events in one write; on failure tell h11 (``send_failed``) and re-raise."""
    data = b"".join(conn.send(event) or b"" for event in events)
    try:
        await stream.send_all(data)
    except BaseException:
        conn.send_failed()
        raise


def phrase(status: int) -> bytes:
    """The reason phrase of ``status`` (empty for a status HTTP does not name)."""
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def with_close(response: h11.Response) -> h11.Response:
    """``response`` with ``Connection: close`` (h11 then closes after it)."""
    headers = list(response.headers)
    if (b"connection", b"close") in headers:
        return response
    return h11.Response(
        status_code=response.status_code,
        headers=[*headers, (b"connection", b"close")],
        reason=response.reason,
        http_version=response.http_version,
    )


def json_answer(
    status: int, document: dict[str, object], headers: Headers | None = None, *, close: bool = False
) -> tuple[h11.Response, h11.Data, h11.EndOfMessage]:
    """The events of a complete JSON response."""
    body = json.dumps(document).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    head += headers or []
    if close:
        head.append((b"connection", b"close"))
    return (
        h11.Response(status_code=status, reason=phrase(status), headers=head),
        h11.Data(data=body),
        h11.EndOfMessage(),
    )
