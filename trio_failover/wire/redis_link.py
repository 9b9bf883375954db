"""The wire under ``redis.py``: RESP in and out, connecting, logging in, errors mapped once.

hiredis writes the commands (``pack_command``) and parses the replies (its
``Reader``, the C parser redis-py uses). Trio, OS, TLS and protocol errors
become ``core/errors.py``'s ``StateError`` tree here and nowhere else.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypeAlias

import hiredis
import trio

from ..core.errors import StateReplyError, StateTimeout, StateUnavailable
from ..core.redis_url import RedisAddress
from . import connect, sockopts

__all__ = [
    "IO_ERRORS",
    "READ_SIZE",
    "Arg",
    "Link",
    "Reply",
    "checked",
    "command_name",
    "login_commands",
    "open_link",
    "pack",
]

Arg: TypeAlias = bytes | str | int | float
Reply: TypeAlias = "bytes | int | list[Reply] | None"

READ_SIZE = 65536
# The socket errors of a lost connection; TLS failures are OSErrors too.
IO_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


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
