"""A small Redis client on Trio: RESP2 written with hiredis' packer, read with its C parser.

Why our own, not ``coredis``: docs/replicas.md ("The client: why our
own"). hiredis comes with the ``redis`` extra.

Two kinds of connection:

- ``RedisConnection``, for commands (``open_redis``): many tasks may call
  it at once; each call's commands are written in one write, and
  whichever caller is waiting reads the socket and hands each reply to its
  call, in order. So calls pipeline on one socket, and a caller that gives
  up (its deadline, or a cancellation) leaves the connection in step: its
  replies are read and dropped.
- ``Subscription``, a connection in subscribe mode: the caller's own task
  reads the messages, ``async for message in subscription``.

Deadlines: every call takes an absolute Trio time, ``deadline``, and raises
``StateTimeout`` when it passes (the ``--state-timeout`` design: a request
never waits on Redis beyond it). Errors are mapped once, here, into
``core/errors.py``'s ``StateError`` tree. Reconnecting is the caller's: a
lost connection fails its pending calls and every later one with
``StateUnavailable``, and ``wait_closed()`` returns.
"""

from __future__ import annotations

import hashlib
import ssl
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeAlias

import attrs
import hiredis
import trio

from ..core.errors import StateError, StateReplyError, StateTimeout, StateUnavailable
from ..core.redis_url import RedisAddress
from . import connect, http1, sockopts

__all__ = [
    "Arg",
    "Message",
    "RedisConnection",
    "Reply",
    "Script",
    "Subscription",
    "checked",
    "open_redis",
    "open_subscription",
]

Arg: TypeAlias = bytes | str | int | float
Reply: TypeAlias = "bytes | int | list[Reply] | None"

READ_SIZE = 65536
# The socket errors of a lost connection; TLS failures are OSErrors too.
IO_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

# What a posted call's replies go to: the replies, or the error that ended it.
OnReplies = Callable[[list[object] | StateError], None]


@attrs.frozen
class Script:
    """A Lua script and its SHA1, the name ``EVALSHA`` runs it by."""

    source: str
    sha1: str = attrs.field(init=False)

    @sha1.default
    def _sha1(self) -> str:
        return hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()


@attrs.frozen
class Message:
    """One message of a subscription."""

    channel: bytes
    data: bytes


class RedisConnection(trio.abc.AsyncResource):
    """A connection for commands, shared by any number of tasks. Get one from ``open_redis``.

    No reader task: a caller whose replies are not in yet reads the socket
    itself (``Replies``). One command alone costs one scheduler
    pass (the wait for its reply; ``http1.send`` writes without one); a
    reader task would add two (docs/performance.md).

    A lost connection is noticed by the next call (a closed socket answers
    at once); the ``Subscription`` of the same server, which always reads,
    is the one that notices an idle connection's server going away.
    """

    def __init__(self, link: Link, address: RedisAddress) -> None:
        self.address = address
        self._link = link
        self._send_lock = trio.StrictFIFOLock()
        self._replies = Replies(link, self._lose)
        self._pending = self._replies.pending
        self._closed_reason: str | None = None
        self._closed = trio.Event()

    @property
    def closed_reason(self) -> str | None:
        """Why the connection is closed (lost, closed by us...); None while it is open."""
        return self._closed_reason

    async def execute(self, *command: Arg, deadline: float) -> Reply:
        """Run one command.

        Args:
            command: the name and arguments, e.g. ``("INCR", "hits")``.
            deadline: Trio time by which the answer must be in.

        Returns:
            The reply: ``bytes``, ``int``, ``None`` or a list of those.

        Raises:
            StateTimeout: no answer by ``deadline``; the connection stays usable
                (the late reply is read and dropped).
            StateReplyError: Redis answered with an error.
            StateUnavailable: the connection is lost or closed.

        Cancellation: safe at any point; as after a timeout, the connection
        stays in step.
        """
        (reply,) = await self.pipeline([command], deadline=deadline)
        return reply

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, deadline: float) -> list[Reply]:
        """Run several commands in one write and one wait; their replies in order.

        All the replies are read before an error reply is raised (the first
        one's), so the connection stays in step. Raises as ``execute``.
        """
        operation = command_name(commands[0]) if len(commands) == 1 else "pipeline"
        replies = await self._call(commands, deadline, operation)
        return [checked(operation, reply) for reply in replies]

    async def run_script(
        self, script: Script, keys: Sequence[Arg], args: Sequence[Arg], *, deadline: float
    ) -> Reply:
        """``EVALSHA`` the script; ``EVAL`` it (which also loads it) if the server lacks it.

        The fallback runs within the same deadline; it happens once per
        server start or ``SCRIPT FLUSH``. Raises as ``execute``.
        """
        tail = (len(keys), *keys, *args)
        try:
            return await self.execute("EVALSHA", script.sha1, *tail, deadline=deadline)
        except StateReplyError as exc:
            if exc.code != "NOSCRIPT":
                raise
        return await self.execute("EVAL", script.source, *tail, deadline=deadline)

    async def post(
        self, commands: Sequence[Sequence[Arg]], *, deadline: float, on_replies: OnReplies
    ) -> bool:
        """Write the commands and return without waiting for their replies.

        The replies are read by whichever call reads the socket next (a
        later call first takes in what has already arrived, without a wait)
        and handed to ``on_replies``, unchecked, from that task; a lost
        connection hands it the ``StateUnavailable``. For what nobody needs
        to wait for: a slot's release costs the request path a write, not a
        round trip. Returns False, having written nothing, when the
        connection is closed or ``deadline`` passed before the write.

        Shielded from cancellation (a release in the ``finally`` of a
        cancelled attempt still goes out), bounded by ``deadline``: a write
        the kernel cannot take by then (a server that stopped reading) is
        cut short, which loses the connection.
        """
        if self._closed_reason is not None:
            return False
        call = Call(len(commands), on_done=on_replies)
        with trio.CancelScope(deadline=deadline, shield=True):
            try:
                return await self._send(call, pack(commands), deadline, "post")
            except StateUnavailable:
                return False
        return False

    async def aclose(self) -> None:
        """Close the connection; pending and later calls raise ``StateUnavailable``."""
        self._lose("closed")
        await trio.aclose_forcefully(self._link.stream)

    async def wait_closed(self) -> None:
        """Return once the connection is lost or closed."""
        await self._closed.wait()

    async def _call(
        self, commands: Sequence[Sequence[Arg]], deadline: float, operation: str
    ) -> list[object]:
        """Write the commands, then wait for their replies, all by ``deadline``."""
        start = trio.current_time()
        if self._closed_reason is not None:
            await trio.lowlevel.checkpoint()
            raise StateUnavailable(operation, self._closed_reason)
        call = Call(len(commands))
        with trio.move_on_at(deadline):
            if await self._send(call, pack(commands), deadline, operation):
                await self._replies.wait(call)
            else:
                await trio.lowlevel.checkpoint()  # cancelled at once: the deadline passed
        if call.error is not None:
            raise call.error
        if not call.done:
            # Left in the queue: whoever reads next drops its replies.
            raise StateTimeout(operation, deadline - start)
        return call.replies

    async def _send(self, call: Call, payload: bytes, deadline: float, operation: str) -> bool:
        """Queue ``call`` and write its commands, in the same order as the other callers'.

        Returns False, having written nothing, when ``deadline`` has passed.
        """
        try:
            self._send_lock.acquire_nowait()  # the usual case, without a scheduler pass
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            if self._closed_reason is not None:
                raise StateUnavailable(operation, self._closed_reason)
            if trio.current_time() >= deadline:
                return False
            # A write cancelled half-way leaves the stream in an unknown state.
            # Past this check, though, Trio can cancel it only while it waits
            # for the kernel to take the rest (its buffer full: a server that
            # stopped reading). http1.send writes what the kernel takes at
            # once without a checkpoint (the usual case: the reply's wait is
            # the call's scheduler pass), and Trio's own send_all (TLS) ends a
            # write that went through in a shielded checkpoint. So a
            # cancellation here breaks the connection only when it is broken.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._pending.add(call)
            try:
                await http1.send(self._link.stream, payload)
            except IO_ERRORS as exc:
                self._lose(f"connection lost: {exc.__cause__ or exc}")
            except trio.Cancelled:
                self._lose("a write was cut short (the server stopped reading)")
                raise
            return True
        finally:
            self._send_lock.release()

    def _lose(self, reason: str) -> None:
        """Mark the connection closed for ``reason`` and fail every pending call."""
        if self._closed_reason is None:
            self._closed_reason = reason
        self._pending.fail_all(self._closed_reason)
        self._closed.set()


async def open_redis(
    address: RedisAddress,
    *,
    deadline: float,
    ssl_context: ssl.SSLContext | None = None,
    client_name: str | None = None,
    dead_peer_timeout: float = 30.0,
) -> RedisConnection:
    """Connect and log in: ``async with await open_redis(address, deadline=...) as conn:``.

    Args:
        address: from ``core.redis_url.parse_redis_url``.
        deadline: Trio time by which connect, TLS, AUTH, SELECT and a PING
            must all be done.
        ssl_context: for ``rediss://``; the system's default when None.
        client_name: shown by the server's ``CLIENT LIST``.
        dead_peer_timeout: TCP keepalive, as ``--dead-peer-timeout``; 0 = off.

    Raises:
        StateTimeout: not connected and answered by ``deadline``.
        StateUnavailable: the connection failed.
        StateReplyError: the server refused the login (``WRONGPASS``...) or the database.
    """
    link = await open_link(
        address, deadline, ssl_context, dead_peer_timeout, login_commands(address, client_name)
    )
    return RedisConnection(link, address)


class Subscription(trio.abc.AsyncResource):
    """A connection in subscribe mode; get one from ``open_subscription``.

    ``async with await open_subscription(...) as subscription:``, then
    ``async for message in subscription`` yields every message of the
    channels, with no deadline of its own (wrap it if you want one). The
    iteration raises ``StateUnavailable`` when the connection is lost and
    ends after ``aclose()``.
    """

    def __init__(self, link: Link, channels: tuple[str, ...]) -> None:
        self.channels = channels
        self._link = link
        self._closed = False

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Message:
        while not self._closed:
            try:
                (reply,) = await self._link.read_replies(1, float("inf"), "subscription")
            except StateUnavailable:
                if self._closed:
                    break
                raise
            # In subscribe mode RESP2 carries pushes as arrays: ["message",
            # channel, data]; confirmations and PONGs are not messages.
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                channel, data = reply[1], reply[2]
                if isinstance(channel, bytes) and isinstance(data, bytes):
                    return Message(channel, data)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Close the connection; the iteration ends."""
        self._closed = True
        await trio.aclose_forcefully(self._link.stream)


async def open_subscription(
    address: RedisAddress,
    channels: Sequence[str],
    *,
    deadline: float,
    ssl_context: ssl.SSLContext | None = None,
    dead_peer_timeout: float = 30.0,
) -> Subscription:
    """Connect, log in and ``SUBSCRIBE``, all by ``deadline``.

    Messages published once this returns are delivered (the server has
    confirmed every channel). Raises as ``run_redis``; reconnecting is the
    caller's, and so is what was missed meanwhile.
    """
    commands = [*login_commands(address, None), ("SUBSCRIBE", *channels)]
    # SUBSCRIBE answers once per channel.
    link = await open_link(
        address, deadline, ssl_context, dead_peer_timeout, commands, len(channels) - 1
    )
    return Subscription(link, tuple(channels))


# The wire: RESP in and out, connecting, logging in, errors mapped once.
#
# hiredis writes the commands (``pack_command``) and parses the replies (its
# ``Reader``, the C parser redis-py uses). Trio, OS, TLS and protocol errors
# become ``core/errors.py``'s ``StateError`` tree here and nowhere else.


def command_name(command: Sequence[Arg]) -> str:
    """The command's name, for errors: ``INCR``, ``EVALSHA``..."""
    first = command[0] if command else b"?"
    return (first.decode(errors="replace") if isinstance(first, bytes) else str(first)).upper()


def pack(commands: Sequence[Sequence[Arg]]) -> bytes:
    """The commands in RESP, written by hiredis' C packer."""
    # hiredis' stub types the argument as a 1-tuple; any tuple of Args works.
    if len(commands) == 1:
        return hiredis.pack_command(tuple(commands[0]))  # type: ignore[arg-type,no-any-return]
    return b"".join(hiredis.pack_command(tuple(command)) for command in commands)  # type: ignore[arg-type]


def checked(operation: str, reply: object) -> Reply:
    """``reply`` as a ``Reply``; an error reply anywhere in it raises.

    Raises:
        StateReplyError: Redis answered an error (hiredis gives those as
            ``ReplyError`` values, not exceptions).
    """
    if isinstance(reply, hiredis.ReplyError):
        raise StateReplyError(operation, str(reply))
    if isinstance(reply, list):
        for item in reply:
            checked(operation, item)
    return reply  # type: ignore[return-value]  # hiredis' RESP2 types, checked above


@contextmanager
def _io(operation: str) -> Iterator[None]:
    """Map a lost connection or bad bytes to ``StateUnavailable``."""
    try:
        yield
    except hiredis.ProtocolError as exc:
        raise StateUnavailable(operation, f"not Redis' protocol: {exc}") from exc
    except IO_ERRORS as exc:
        raise StateUnavailable(operation, f"connection lost: {exc.__cause__ or exc}") from exc


async def _open_stream(
    address: RedisAddress,
    deadline: float,
    ssl_context: ssl.SSLContext | None,
    dead_peer_timeout: float,
) -> trio.abc.Stream:
    """TCP (and TLS for ``rediss://``) to the server, within ``deadline``."""
    start = trio.current_time()
    with trio.move_on_at(deadline) as scope, _io("connect"):
        tcp = await connect.open_tcp(address.host, address.port)
        try:
            # Keepalive: a subscription only reads, so without it a Redis host
            # that vanished would look like a quiet channel for ever.
            sockopts.apply_upstream_options(tcp.socket, dead_peer_timeout)
            if not address.tls:
                return tcp
            context = ssl_context or ssl.create_default_context()
            tls = trio.SSLStream(tcp, context, server_hostname=address.host)
            await tls.do_handshake()
            return tls
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
    assert scope.cancelled_caught
    raise StateTimeout("connect", deadline - start)


def login_commands(address: RedisAddress, client_name: str | None) -> list[tuple[Arg, ...]]:
    """The commands that open a session: AUTH, SELECT, CLIENT SETNAME, PING.

    PING is always sent, so a connection counts as open only once the server
    has answered it (a listener that never answers is a timeout, not a
    connection that fails later on the request path).
    """
    commands: list[tuple[Arg, ...]] = []
    if address.password is not None:
        if address.username:
            commands.append(("AUTH", address.username, address.password))
        else:
            commands.append(("AUTH", address.password))
    if address.db:
        commands.append(("SELECT", address.db))
    if client_name:
        commands.append(("CLIENT", "SETNAME", client_name))
    commands.append(("PING",))
    return commands


class Link:
    """A stream and its reply parser: write commands, read whole replies."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.parser = hiredis.Reader()

    async def read_replies(self, count: int, deadline: float, operation: str) -> list[object]:
        """Read ``count`` replies in this task (the handshake, and a subscription's messages)."""
        replies: list[object] = []
        start = trio.current_time()
        with trio.move_on_at(deadline), _io(operation):
            while True:
                while len(replies) < count and (reply := self.parser.gets()) is not False:
                    replies.append(reply)
                if len(replies) == count:
                    return replies
                data = await self.stream.receive_some(READ_SIZE)
                if not data:
                    raise StateUnavailable(operation, "the server closed the connection")
                self.parser.feed(data)  # type: ignore[arg-type]  # bytearray is fine too
        raise StateTimeout(operation, deadline - start)

    async def handshake(
        self, commands: Sequence[Sequence[Arg]], extra_replies: int, deadline: float
    ) -> list[object]:
        """Send ``commands`` at once and check their replies (plus ``extra_replies`` more)."""
        start = trio.current_time()
        with trio.move_on_at(deadline), _io("connect"):
            await self.stream.send_all(pack(commands))
        if trio.current_time() >= deadline:
            raise StateTimeout("connect", deadline - start)
        replies = await self.read_replies(len(commands) + extra_replies, deadline, "connect")
        for command, reply in zip(commands, replies, strict=False):
            checked(command_name(command), reply)
        return replies


async def open_link(
    address: RedisAddress,
    deadline: float,
    ssl_context: ssl.SSLContext | None,
    dead_peer_timeout: float,
    commands: Sequence[Sequence[Arg]],
    extra_replies: int = 0,
) -> Link:
    """Connect and run the session's first commands, or close and raise."""
    link = Link(await _open_stream(address, deadline, ssl_context, dead_peer_timeout))
    try:
        await link.handshake(commands, extra_replies, deadline)
    except BaseException:
        await trio.aclose_forcefully(link.stream)
        raise
    return link


# The calls in flight on one ``RedisConnection``: whose replies come next,
# and where they go.
#
# Replies come back in the order the commands were written; ``InFlight``
# hands each one to the oldest call still waiting for some, whether its
# caller waits for it (``execute``: woken when they are in), left (a
# deadline or a cancellation: the replies are read and dropped), or never
# waited (``post``: a callback takes them).


@attrs.define(eq=False, slots=True)
class Call:
    """One caller's commands in flight; the replies come in as they are read."""

    expected: int
    replies: list[object] = attrs.Factory(list)
    error: StateError | None = None
    done: bool = False
    # Set while the caller waits for another task to read its replies:
    # set() when they are in, or when it is this caller's turn to read.
    wake: trio.Event | None = None
    # A posted call (``RedisConnection.post``): nobody waits; called when it ends.
    on_done: OnReplies | None = None

    def finish(self) -> None:
        """The replies are in, or the call failed: wake its caller, or tell its callback."""
        self.done = True
        if self.wake is not None:
            self.wake.set()
        if self.on_done is not None:
            self.on_done(self.error if self.error is not None else self.replies)


class InFlight:
    """The calls whose commands were written, oldest first: where each reply read goes."""

    def __init__(self) -> None:
        self._calls: deque[Call] = deque()

    def add(self, call: Call) -> None:
        """``call``'s commands are being written: its replies come after the others'."""
        self._calls.append(call)

    def deliver(self, reply: object) -> bool:
        """Hand one reply to the oldest call (kept, if its caller left); False: no call waits."""
        if not self._calls:
            return False
        call = self._calls[0]
        call.replies.append(reply)
        if len(call.replies) == call.expected:
            self._calls.popleft()
            call.finish()
        return True

    def first_is_posted(self) -> bool:
        """Whether the oldest call is a posted one, whose replies nobody waits to read."""
        return bool(self._calls) and self._calls[0].on_done is not None

    def wake_next_reader(self) -> None:
        """Wake the first caller still waiting: it reads next."""
        for call in self._calls:
            if call.wake is not None:
                call.wake.set()
                return

    def fail_all(self, reason: str) -> None:
        """End every call with ``StateUnavailable`` for ``reason``."""
        while self._calls:
            call = self._calls.popleft()
            call.error = StateUnavailable("reply", reason)
            call.finish()


class Replies:
    """The read side of one connection: who reads the socket, and where each reply goes.

    A caller whose replies are not in yet reads the socket itself, unless
    another caller already does, and hands every reply it reads to the
    call it belongs to. When a reading caller leaves (its replies are in,
    its deadline passed, it was cancelled) the next waiting one takes
    over. Cancelling a read loses nothing: Trio's socket and (after its
    handshake) TLS streams give up before taking any bytes. ``lose`` is the
    connection's: it marks it closed and fails every call.
    """

    def __init__(self, link: Link, lose: Callable[[str], None]) -> None:
        self.link = link
        self.pending = InFlight()
        self._reading = False
        self._lose = lose

    async def wait(self, call: Call) -> None:
        """Until ``call``'s replies are in: read them, or wait while another task reads."""
        try:
            if not self._reading and self.pending.first_is_posted():
                self._read_now()  # posted replies that came meanwhile, without a wait
            while not call.done:
                if self._reading:
                    call.wake = trio.Event()
                    await call.wake.wait()
                    continue
                self._reading = True
                try:
                    await self._read_some()
                finally:
                    self._reading = False
        finally:
            call.wake = None
            if not self._reading:  # let the first caller still waiting read
                self.pending.wake_next_reader()

    async def _read_some(self) -> None:
        """One read from the socket (``http1.receive`` waits first: no reply is there yet)."""
        try:
            data = await http1.receive(self.link.stream, READ_SIZE)
        except IO_ERRORS as exc:
            self._lose(f"connection lost: {exc.__cause__ or exc}")
            return
        self._take_in(data)

    def _read_now(self) -> None:
        """Take in what the kernel already holds (no wait, not a checkpoint)."""
        try:
            data = http1.read_now(self.link.stream, READ_SIZE)
        except IO_ERRORS as exc:
            self._lose(f"connection lost: {exc.__cause__ or exc}")
            return
        if data is not None:
            self._take_in(data)

    def _take_in(self, data: bytes) -> None:
        """Every whole reply in ``data`` to its call; b"" is the server's end."""
        if not data:
            self._lose("the server closed the connection")
            return
        parser = self.link.parser
        try:
            parser.feed(data)
            while (reply := parser.gets()) is not False:
                if not self.pending.deliver(reply):
                    self._lose("a reply nobody asked for")
        except hiredis.ProtocolError as exc:
            self._lose(f"not Redis' protocol: {exc}")
