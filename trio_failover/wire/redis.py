"""A small Redis client on Trio: RESP2 written with hiredis' packer, read with its C parser.

Why our own: measured under Trio, ``coredis`` (which runs on Trio through
anyio) costs about 0.4 ms of CPU a command, four times this module and six
times a command written by hand (docs/performance.md, "The shared state's
client"); the slot take is on every request's path, where that is more
than the whole request costs today. hiredis is the C parser redis-py uses;
it comes with the ``redis`` extra.

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
never waits on Redis beyond it). Errors are mapped once, here and in
``redis_link.py``, into ``core/errors.py``'s ``StateError`` tree. Reconnecting is the caller's: a
lost connection fails its pending calls and every later one with
``StateUnavailable``, and ``wait_closed()`` returns.
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Sequence

import attrs
import trio

from ..core.errors import StateReplyError, StateTimeout, StateUnavailable
from ..core.redis_url import RedisAddress
from . import socket_io
from .redis_calls import Call, OnReplies, Replies
from .redis_link import (
    IO_ERRORS,
    Arg,
    Link,
    Reply,
    checked,
    command_name,
    login_commands,
    open_link,
    pack,
)

__all__ = [
    "Arg",
    "Message",
    "OnReplies",
    "RedisConnection",
    "Reply",
    "Script",
    "Subscription",
    "open_redis",
    "open_subscription",
]


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
    itself (``redis_calls.Replies``). One command alone costs one scheduler
    pass (the wait for its reply; ``socket_io`` writes without one); a
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
            # stopped reading). socket_io.send writes what the kernel takes at
            # once without a checkpoint (the usual case: the reply's wait is
            # the call's scheduler pass), and Trio's own send_all (TLS) ends a
            # write that went through in a shielded checkpoint. So a
            # cancellation here breaks the connection only when it is broken.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._pending.add(call)
            try:
                await socket_io.send(self._link.stream, payload)
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
