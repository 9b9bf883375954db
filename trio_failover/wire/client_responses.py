"""Writing to the client: answers in one write each, error answers, the lingering close."""

from __future__ import annotations

import contextlib

import h11
import trio

from ..core.answers import error_document
from ..core.errors import ClientError
from . import socket_io
from .client_reader import ClientReader
from .client_requests import RequestReader
from .drain import Drain
from .http1 import json_answer, with_close

__all__ = ["LINGER_IDLE_TIMEOUT", "LINGER_TIMEOUT", "ClientGone", "ResponseWriter"]

# After an error answer the client may still be sending (a body over the
# limit, say). Closing with its bytes unread makes the kernel reset the
# connection, which can destroy the answer before the client reads it (RFC
# 9112 section 9.6). So the proxy half-closes and discards what still comes,
# for a bounded time: nginx's "lingering close".
LINGER_TIMEOUT = 5.0  # in all
LINGER_IDLE_TIMEOUT = 1.0  # without a byte from the client


class ClientGone(Exception):
    """The client connection broke while the proxy was writing to it."""


class ResponseWriter:
    """Sends h11 events on the request side's current h11 connection.

    ``drain`` is read before each answer: once the server drains, the
    answer says "Connection: close", so that a keep-alive client does not
    send a next request into a connection about to close.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        requests: RequestReader,
        reader: ClientReader,
        drain: Drain,
        *,
        admin: bool = False,
    ) -> None:
        self._stream = stream
        self._admin = admin
        self._requests = requests
        self._reader = reader
        self._drain = drain

    async def send(self, *events: h11.Event) -> None:
        """Send h11 events in one write (body data is left out in answer to HEAD).

        Raises:
            ClientGone: the client connection broke.
        """
        conn = self._requests.conn
        start = events[0]
        if isinstance(start, h11.Response):
            # Only the call that starts an answer can need rewriting; the
            # relay's per-chunk calls skip this.
            if self._requests.answering_head:
                # h11 refuses body bytes after a HEAD (and then sends nothing
                # at all); an answer the proxy makes itself keeps its head only.
                events = tuple(event for event in events if not isinstance(event, h11.Data))
            if self._drain.active:
                events = (with_close(start), *events[1:])
        data = b"".join(conn.send(event) or b"" for event in events)
        try:
            await socket_io.send(self._stream, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            conn.send_failed()
            raise ClientGone(str(exc)) from exc

    async def send_data(self, data: bytes) -> None:
        """Send body bytes of a committed answer in one write: the relay's per-chunk call.

        ``send(h11.Data(data=data))`` without its tuple, its search for a head
        and its join: the hot path of a stream.

        Raises:
            ClientGone: the client connection broke.
        """
        conn = self._requests.conn
        out = conn.send(h11.Data(data=data))
        assert out is not None  # only ConnectionClosed sends nothing
        try:
            await socket_io.send(self._stream, out)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            conn.send_failed()
            raise ClientGone(str(exc)) from exc

    async def send_json(
        self,
        status: int,
        document: dict[str, object],
        headers: list[tuple[bytes, bytes]] | None = None,
        *,
        close: bool = False,
    ) -> int:
        """Send a complete JSON response; returns the body bytes sent (none after a HEAD)."""
        events = json_answer(status, document, headers, close=close)
        body = 0 if self._requests.answering_head else len(events[1].data)
        await self.send(*events)
        return body

    async def send_client_error(self, error: ClientError) -> None:
        """Answer a bad request with its JSON error; the connection then closes.

        Ollama's shape when the request line is well-formed and names a path
        under ``/api/``; otherwise, also when that line is malformed, OpenAI's.
        """
        if self._requests.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        path = self._requests.error_path()
        document = error_document(path, error.status, error.code, str(error), admin=self._admin)
        try:
            await self.send_json(error.status, document, close=True)
        except (ClientGone, h11.LocalProtocolError):
            return
        await self._linger()

    async def _linger(self) -> None:
        """Half-close, then discard the client's bytes until it closes (bounded)."""
        reader = self._reader
        with trio.move_on_after(LINGER_TIMEOUT):
            if isinstance(self._stream, trio.abc.HalfCloseableStream):
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._stream.send_eof()
            while reader.closed is None:
                reader.discard()
                with trio.move_on_after(LINGER_IDLE_TIMEOUT) as idle:
                    await reader.wait_arrival()
                if idle.cancelled_caught:
                    break
        reader.discard()
