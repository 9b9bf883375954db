"""The client side of one connection, its whole life: the request loop with its
keep-alive waits, on three parts that each do one job:

- ``client_reader.py``: the one task that reads the client and doubles as the
  close watcher (FIN or RST, seen at any moment);
- ``client_requests.py``: h11 server state, the head screen, reading one
  request under its size limits and deadlines;
- ``client_responses.py``: writing answers, error answers and the lingering
  close.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import h11
import trio

from ..core.errors import ClientError
from .client_reader import PENDING_LIMIT, ClientReader, Closed, TakenOver
from .client_requests import ClientRequest, RequestReader
from .client_responses import ClientGone, ResponseWriter
from .drain import Drain

__all__ = ["Admit", "ClientConnection", "ClientGone", "ClientRequest", "Closed", "Handler"]

logger = logging.getLogger("trio_failover")

Handler = Callable[["ClientConnection", ClientRequest], Awaitable[bool]]
# Whether a request, by its head, may have its body buffered (a key check).
Admit = Callable[[list[tuple[bytes, bytes]]], bool]


class ClientConnection:
    """One client connection: its reader, h11 server state, keep-alive and deadlines.

    ``serve(handler)`` runs the whole connection: it waits for each request
    (within ``client_header_timeout`` for the first, ``keepalive_timeout``
    between requests), reads it, and hands it to ``handler``, which answers
    and says whether the connection may carry another.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_head: int,
        max_body: int,
        client_header_timeout: float,
        keepalive_timeout: float = math.inf,
        drain: Drain | None = None,
        admit: Admit | None = None,
        admin: bool = False,
    ) -> None:
        self.stream = stream
        self._admit = admit
        self._drain = drain or Drain()
        self._keepalive_timeout = keepalive_timeout
        self._header_timeout = client_header_timeout
        # The first head is due one header timeout after the connection
        # opened (as with nginx's client_header_timeout), not after its
        # first byte: a client may not spend the timeout twice.
        self._opened = trio.current_time()
        # The reader may hold a whole head, and one byte more to tell that it
        # is too large, before h11 gets any of it.
        self._reader = ClientReader(stream, max(PENDING_LIMIT, max_head + 1))
        self._requests = RequestReader(
            self._reader,
            max_head=max_head,
            max_body=max_body,
            header_timeout=client_header_timeout,
        )
        # ``admin``: the admin listener's connection, whose error answers
        # say so in their ``type`` (``core.answers``).
        self._writer = ResponseWriter(
            stream, self._requests, self._reader, self._drain, admin=admin
        )
        # The parts' methods under the connection's names, which the workload
        # and the tests call: bound once, not wrapped per call.
        self.run_reader = self._reader.run
        self.wait_closed = self._reader.wait_closed
        self.watch = self._reader.watch
        self.wait_input = self._reader.wait_input
        self.prepare_next = self._requests.prepare_next
        self.has_buffered = self._requests.has_buffered
        self.send = self._writer.send
        self.send_data = self._writer.send_data
        self.send_json = self._writer.send_json
        self.send_client_error = self._writer.send_client_error

    @property
    def closed(self) -> Closed | None:
        """How the client's side ended (None: it has not)."""
        return self._reader.closed

    @property
    def conn(self) -> h11.Connection:
        """The h11 connection of the request cycle in progress."""
        return self._requests.conn

    @property
    def requests_read(self) -> int:
        """How many request heads were read on this connection."""
        return self._requests.requests_read

    @property
    def reusable(self) -> bool:
        """Whether another request may follow on this connection."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    async def serve(self, handler: Handler) -> None:
        """Serve requests with ``handler`` until the connection ends; closes the stream."""
        try:
            async with trio.open_nursery() as nursery:
                self._reader.receive_ready()
                nursery.start_soon(self.run_reader)
                await self._serve_requests(handler)
                nursery.cancel_scope.cancel()
        finally:
            await self.aclose()

    async def _serve_requests(self, handler: Handler) -> None:
        while self.prepare_next():
            if not await self._wait_for_request():
                return
            try:
                request = await self.read_request()
            except ClientError as exc:
                logger.info(
                    "bad request", extra={"fields": {"status": exc.status, "error": str(exc)}}
                )
                await self.send_client_error(exc)
                return
            if request is None:
                return
            if not await handler(self, request):
                return

    async def _wait_for_request(self) -> bool:
        """Wait (idle) for the first byte of a next request; False: give up."""
        if self.has_buffered():
            return True
        timeout = self._header_timeout if self.requests_read == 0 else self._keepalive_timeout
        with self._drain.idle(timeout):
            await self.wait_input()
        return self.has_buffered() and not (self._drain.active and self.closed is not None)

    async def read_request(self) -> ClientRequest | None:
        """The next complete request, or None when the client closed between requests.

        The whole head must arrive within the header timeout; the body may
        pause at most one header timeout between its bytes.

        Raises:
            ClientError: 400 malformed, 408 too slow, 413 body too large,
                431 head too large.
        """
        started = self._opened if self.requests_read == 0 else trio.current_time()
        read = await self._requests.read_head(started)
        if read is None:
            return None
        head, headers = read
        # A request refused by its head (no valid key) never gets its body
        # buffered: a client without a key cannot make the proxy hold
        # --max-request-body bytes per connection. Nor is it invited to send
        # a body only to have it dropped (no 100 Continue).
        refused = self._admit is not None and not self._admit(headers)
        if not refused and self.conn.they_are_waiting_for_100_continue:
            await self.send(h11.InformationalResponse(status_code=100, headers=[]))
        body = await self._requests.read_body(keep=not refused)
        return ClientRequest(
            method=head.method,
            target=head.target,
            headers=headers,
            body=body,
            http_version=head.http_version,
            refused=refused,
        )

    def take_over(self, replay: bytes) -> TakenOver:
        """The connection from here on as a stream, for a protocol that takes it over.

        It returns ``replay`` (say, the upgrade request, which a WebSocket
        library wants to read itself), then the bytes h11 holds beyond the
        request, then the client's next bytes. The request loop must not
        read again: the handler that takes over ends the connection.
        """
        return TakenOver(replay + self.conn.trailing_data[0], self._reader, self.stream)

    async def aclose(self) -> None:
        """Close the connection (abortive, never blocks)."""
        await trio.aclose_forcefully(self.stream)
