"""One attempt at one node: connect, write the request, read the head, wait
for the first body bytes; then, after commit, the rest of the body
(``UpstreamResponse``).

Each deadline wraps the smallest operation that owns it:

    connect (+TLS)         connect_timeout           -> ConnectTimeout
    write request          response_header_timeout   -> HeaderTimeout
    read the whole head    response_header_timeout   -> HeaderTimeout
                           (unstreamed_timeout for a request whose
                           answer comes whole)
    head -> first byte     first_body_timeout (opt)  -> FirstBodyTimeout
                           (an event stream's first line that is not a
                           comment or blank); with 0, no deadline

Silence is the proxy's question, not this module's: the caller's
``Progress`` record is told when the node owes an answer
(``waiting_since``: the request written, then the head read), and the
proxy, which times every wait (``proxy/nodes/silence.py``), asks a silent node
``GET /health`` and cancels the attempt when the node is found down. No
call goes up from here.

Each phase is one function (``connect_node``, ``_request_and_head``,
``_error_body``, ``_first_body`` and ``_first_event``). Trio, OS, TLS and
h11 errors become ``UpstreamError`` subclasses in one place, ``map_error``
(which ``fetch.py``, the proxy's own GETs, uses too), phase by phase; what
they mean for the workload is ``outcome.judge``'s call.
Cancellation: whatever cancels an attempt (client abort, shutdown, a node
found down), its socket is closed at once; only a connection whose
response was relayed to its end goes back to the node's pool
(``pool.py``) instead.
"""

from __future__ import annotations

import math
import re
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import attrs
import h11
import trio

from ..core import errors
from ..core.config import Config, Upstream
from ..core.headers import Headers, get
from ..core.inventory import is_model_not_found
from ..core.outcome import HeadAction, SavedResponse, classify_head, error_code, fails_over_on
from ..core.screen import answer_flaw
from ..core.sse import SseScanner, is_event_stream
from . import http1, sockopts
from .connect import Connector, TCPConnector, open_tcp
from .http1 import RECEIVE_SIZE, EarlyClose, next_event, read_body, read_chunk, read_prefix
from .pool import ConnectionPool

__all__ = [
    "Connector",
    "OutgoingRequest",
    "Progress",
    "TCPConnector",
    "Timings",
    "UpstreamResponse",
    "connect_node",
    "head_timed_out",
    "head_wait",
    "map_error",
    "mapped",
    "open_response",
    "open_tcp",
    "without_peer_bytes",
]

# A 4xx error body is read up to this size to look for a retryable
# error.code; a retryable status keeps this much to relay if it is the last
# answer. Anything longer is not an error body worth holding.
ERROR_BODY_LIMIT = 65536

# Comment and blank lines of an event stream held before its first event
# (they are not a first body byte). Pings are a few bytes every few seconds;
# a node that sends this much and no event is not pinging, and holding more
# would be unbounded.
HELD_LIMIT = 65536


# The errors: Trio, OS, TLS and h11 errors of one phase become the
# ``UpstreamError`` subclass that names the outcome, here and nowhere else.

IO_ERRORS = (
    h11.RemoteProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


def map_error(node: str, phase: str, exc: BaseException) -> errors.UpstreamError:
    """The error-tree form of a Trio, OS, TLS or h11 error of one phase."""
    if phase == "connect":
        if isinstance(exc, ssl.SSLError):
            return errors.TLSError(node, phase, f"{exc}")
        if _caused_by(exc, ssl.SSLError):
            return errors.TLSError(node, phase, f"{exc.__cause__}")
        return errors.ConnectFailed(node, phase, f"{exc}")
    if isinstance(exc, EarlyClose):
        return errors.UpstreamClosedEarly(node, phase, f"{exc}")
    if isinstance(exc, h11.RemoteProtocolError):
        return errors.UpstreamProtocolError(node, phase, without_peer_bytes(f"{exc}"))
    if sockopts.is_dead_peer_error(exc):
        return errors.DeadPeer(node, phase, "peer stopped answering")
    if _caused_by(exc, ssl.SSLError):
        return errors.TLSError(node, phase, f"{exc.__cause__ or exc}")
    return errors.UpstreamReset(node, phase, f"{exc.__cause__ or exc}")


@contextmanager
def mapped(node: str, phase: str) -> Iterator[None]:
    """Map Trio, OS, TLS and h11 errors of one phase onto the error tree."""
    try:
        yield
    except (EarlyClose, *IO_ERRORS) as exc:
        raise map_error(node, phase, exc) from exc


# Where h11 quotes the peer's bytes in a message: "illegal status line:
# bytearray(b'...')", "malformed chunk footer: b'..' (expected b'\\r\\n')".
_QUOTED = re.compile(r":?\s*(?:bytearray\()?\bb['\"].*", re.DOTALL)


def without_peer_bytes(message: str) -> str:
    """h11's error message without the raw bytes it quotes.

    On a pooled connection those bytes may be the end of another client's
    answer (a node that sent more than it declared); they go to the
    attempts list of a 502, ``/status``, events and logs, so only h11's
    words for what was wrong are kept.
    """
    return _QUOTED.sub("", message) or "malformed answer"


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):  # a cause chain is short; bound the walk anyway
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@attrs.frozen
class OutgoingRequest:
    """The request as one node receives it (headers already made for that node).

    Its parts are sent without h11's header checks, so they must be valid
    already: the client's method, target and headers passed h11's parser;
    the node's URL parts, its header names and values, and node names passed
    the checks of ``config``; the rest is the proxy's own (a workload id that
    matched its pattern, an address, digits). h11 still checks the method,
    the target and the Host header.

    ``unstreamed`` (``requests.is_unstreamed``): the node sends its head only
    once the whole answer is done, so ``unstreamed_timeout`` bounds the wait
    for it instead of ``response_header_timeout``.

    ``head_timeout``, when set, replaces ``response_header_timeout`` for
    this attempt (``--cold-start-timeout`` at a node that must load
    the model first).
    """

    method: bytes
    target: bytes
    headers: Headers
    body: bytes
    unstreamed: bool = False
    head_timeout: float | None = None


class Progress(Protocol):
    """What the caller is told of an attempt's progress (``proxy/silence.SilenceTimer``).

    ``waiting_since``: since when the node owes an answer (None: it owes
    none yet); ``head_seen``: the head came; ``resends``: requests sent
    again on a fresh connection because a pooled one was found stale.

    ``scope``: the caller's cancel scope, entered around ``open_response``.
    The head's deadline is set on it while the head is awaited (and lifted
    after, whichever way the wait ends), instead of a scope of the wire's
    own: one scope an attempt, not two. A ``Cancelled`` that this deadline
    raises goes up to the caller's scope, which turns it into
    ``head_timed_out``'s error unless the caller cancelled the scope itself.
    """

    waiting_since: float | None
    head_seen: bool
    resends: int
    scope: trio.CancelScope


class _Unwatched:
    """The ``Progress`` of an attempt whose caller passed none: only its scope is used."""

    waiting_since: float | None = None
    head_seen = False
    resends = 0

    def __init__(self) -> None:
        self.scope = trio.CancelScope()


class _StaleConnection(Exception):
    """A pooled connection the node had closed: the request's write failed, nothing reached it."""


@attrs.frozen
class Timings:
    """Trio-clock times of one attempt's milestones."""

    started: float
    written: float
    head: float
    first_body: float


class UpstreamResponse:
    """A committed-ready response: its whole head and its first body bytes.

    ``open_response`` makes it; the relay (``proxy/request/relay.py``) reads the
    rest of the body from it and either gives its connection back to the
    pool or closes it.

    The rest of the body comes from ``receive_chunk``. When the body was
    relayed to its end, ``release`` hands the connection back to the pool
    (if it may carry another request); otherwise ``aclose`` closes it. A
    response that was not read to its end is never pooled.

    An event stream carries its ``scanner`` (``core.sse``), already fed with
    ``first_chunk``, for the relay to go on with; ``progressed`` says whether
    a line other than a comment or a blank one has come (always True for
    other bodies). ``first_chunk`` then holds, in order, the comment lines
    held before the first event.

    ``checks``: the liveness checks the attempt waited on; set
    on the instance only when there were any. ``content_type``: its
    ``Content-Type`` header's value, if any, found once for every reader.
    """

    checks = 0

    def __init__(
        self,
        node: Upstream,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        response: h11.Response,
        first_chunk: bytes,
        complete: bool,
        timings: Timings,
        pool: ConnectionPool | None = None,
        *,
        scanner: SseScanner | None = None,
        progressed: bool = True,
        headers: Headers | None = None,
        content_type: bytes | None = None,
    ) -> None:
        self.node = node
        self.status = response.status_code
        self.reason = response.reason
        # ``headers``: the caller's list of ``response.headers``, if it made
        # one, and with it the ``content_type`` it found in them.
        if headers is None:
            headers = list(response.headers)
            content_type = get(headers, b"content-type")
        self.headers: Headers = headers
        self.content_type = content_type
        self.first_chunk = first_chunk
        self.complete = complete
        self.timings = timings
        self.scanner = scanner
        self.progressed = progressed
        self._stream = stream
        self._conn = conn
        self._pool = pool
        self._open = True
        self._starved = False  # h11 said NEED_DATA after the last bytes read

    async def receive_chunk(self) -> bytes:
        """The next body bytes: all that has arrived, at least one byte.

        After it returns, ``complete`` tells whether the body has ended (the
        bytes returned are then its last, possibly none). Bytes that came in
        one read are returned together, so a burst of small upstream chunks
        costs one client write, never a wait.

        Raises:
            UpstreamError: the connection broke or the node sent bad framing.
        """
        if self.complete:
            return b""
        try:
            data, self.complete, self._starved = await read_chunk(
                self._stream, self._conn, starved=self._starved
            )
        except (EarlyClose, *IO_ERRORS) as exc:
            raise map_error(self.node.name, "body", exc) from exc
        return data

    async def release(self) -> None:
        """Give the connection back to the pool after a complete response, else close it.

        Cancellation: the connection is pooled or closed, never left open.
        """
        if not self._open:
            return
        self._open = False
        origins = self._pool.origins if self._pool is not None else None
        if origins is not None and origins.get(self.node.name) != self.node:
            # A reload moved or removed the node: pooled under its name, the
            # connection could be handed to a node added later by that name.
            await trio.aclose_forcefully(self._stream)
        elif self._pool is not None:  # it checks that the exchange ended cleanly
            chunked = b"chunked" in (get(self.headers, b"transfer-encoding") or b"").lower()
            await self._pool.release(self.node.name, self._stream, self._conn, chunked=chunked)
        else:
            await trio.aclose_forcefully(self._stream)

    async def aclose(self) -> None:
        """Close the connection to the node, forcefully (never blocks)."""
        if self._open:
            self._open = False
            await trio.aclose_forcefully(self._stream)


async def connect_node(node: Upstream, connector: Connector, config: Config) -> trio.abc.Stream:
    """A new connection to ``node`` within ``--connect-timeout``: the connect phase.

    Attempts and the proxy's own GETs (``fetch.py``) connect through it.

    Raises:
        ConnectTimeout: no connection within the timeout.
        ConnectFailed, TLSError: mapped by ``map_error``.
    """
    with trio.move_on_after(config.connect_timeout) as connect_scope:
        try:
            return await connector.connect(node)
        except (OSError, trio.BrokenResourceError) as exc:  # ssl.SSLError is an OSError
            raise map_error(node.name, "connect", exc) from exc
    assert connect_scope.cancelled_caught
    raise errors.ConnectTimeout(node.name, "connect", f"no connection in {config.connect_timeout}s")


async def open_response(
    node: Upstream,
    request: OutgoingRequest,
    *,
    connector: Connector,
    config: Config,
    pool: ConnectionPool | None = None,
    started: float | None = None,
    progress: Progress | None = None,
) -> UpstreamResponse:
    """Run one attempt up to the commit point.

    With a ``pool``, the newest idle connection to the node is used first.
    If the node had closed it, so that the write itself fails (its idle
    timer crossed the request: nothing of it reached the node), the request
    goes out on a fresh connection, within the same attempt: not a node
    failure, no cooldown (counted in ``progress.resends``). Once the request
    is written it is never sent to the node again: a close before the
    answer fails the attempt, as on a fresh connection. The response-header
    deadline runs from the request written on the connection actually used.

    ``started``: when the attempt began, if the caller read the Trio clock
    since its last checkpoint (else read here).

    ``progress``: told when the node owes an answer (``Progress``), so that
    the caller can time the node's silence; its ``scope``, entered by the
    caller, carries the head's deadline. None: the attempt gets a record and
    a scope of its own.

    Returns:
        The response with its head and first body bytes (or its valid empty
        end); nothing has been sent to the client yet.

    Raises:
        UpstreamError: a subclass naming the phase and outcome of the failure;
            ``RetryableResponse`` carries the node's answer in ``.saved``
            (None when its body exceeded ``ERROR_BODY_LIMIT``).

    Cancellation:
        Cancelling closes the connection at once; nothing is left open and
        nothing goes back to the pool.
    """
    if progress is None:  # nobody times this attempt: a record and a scope of its own
        own = _Unwatched()
        with own.scope:
            return await open_response(
                node,
                request,
                connector=connector,
                config=config,
                pool=pool,
                started=started,
                progress=own,
            )
        raise head_timed_out(node.name, head_wait(request, config))  # nothing else cancels it
    if started is None:
        started = trio.current_time()
    if pool is not None:
        idle = await pool.acquire(node.name, now=started)
        if idle is not None:
            try:
                return await _exchange(
                    node,
                    idle.stream,
                    idle.conn,
                    request,
                    config,
                    started,
                    pool,
                    reused=True,
                    progress=progress,
                )
            except _StaleConnection:
                pass  # closed below, outside the handler; then a fresh connection
            except (errors.UpstreamClosedEarly, errors.UpstreamReset) as exc:
                if exc.phase == "head":  # the node closed it as the request came
                    pool.closed_by_node(node.name, idle, trio.current_time())
                await trio.aclose_forcefully(idle.stream)
                raise
            except BaseException:
                await trio.aclose_forcefully(idle.stream)
                raise
            await trio.aclose_forcefully(idle.stream)
            progress.resends += 1
            progress.waiting_since = None
    stream = await connect_node(node, connector, config)
    try:
        return await _exchange(
            node,
            stream,
            h11.Connection(h11.CLIENT),
            request,
            config,
            started,
            pool,
            reused=False,
            progress=progress,
        )
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def _exchange(
    node: Upstream,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    request: OutgoingRequest,
    config: Config,
    started: float,
    pool: ConnectionPool | None,
    *,
    reused: bool,
    progress: Progress,
) -> UpstreamResponse:
    """The phases after connect: request and head, then the error body or the first byte."""
    response, written = await _request_and_head(
        node, stream, conn, request, config, reused, progress
    )
    head_at = trio.current_time()
    progress.waiting_since, progress.head_seen = head_at, True
    action = classify_head(
        response.status_code,
        retry_status=config.retry_status,
        retry_error_codes=config.retry_error_codes,
    )
    scanner, progressed = None, True
    # h11's Headers is a Sequence read item by item in Python: listed once.
    headers = list(response.headers)
    flaw = answer_flaw(response.reason, headers)
    if flaw is not None:  # h11 let it through; relayed, it would reach the client as is
        raise errors.UpstreamProtocolError(node.name, "head", flaw)
    content_type = get(headers, b"content-type")
    if action is not HeadAction.COMMIT:
        first, complete = await _error_body(node.name, stream, conn, response, action, config)
    elif config.first_body_timeout and is_event_stream(content_type):
        scanner = SseScanner()
        first, complete = await _first_event(node.name, stream, conn, config, scanner)
    else:
        first, complete = await _first_body(node.name, stream, conn, config)
        if not config.first_body_timeout and is_event_stream(content_type):
            # Every byte commits (the pings reach the client), but the
            # relay's stream-idle timer waits for the first event line.
            scanner = SseScanner()
            progressed = scanner.progress(first)
    timings = Timings(started, written, head_at, trio.current_time())
    return UpstreamResponse(
        node,
        stream,
        conn,
        response,
        first,
        complete,
        timings,
        pool,
        scanner=scanner,
        progressed=progressed,
        headers=headers,
        content_type=content_type,
    )


async def _request_and_head(
    node: Upstream,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    request: OutgoingRequest,
    config: Config,
    reused: bool,
    progress: Progress,
) -> tuple[h11.Response, float]:
    """Write the request and read the whole head (1xx skipped); the head and when it was written.

    Two deadlines, each set once: a write the kernel does not take at once
    must finish within one response-header timeout (a node that does not
    even take the request is as stalled as one that takes it and never
    answers); then, from the request fully written, the whole head must
    come within the same length, or the unstreamed timeout for a request
    whose answer comes whole. A write taken at once (nearly every request:
    a small one on a connection with room in its send buffer) has no
    deadline to run. The head's deadline (``head_wait``) is set on
    ``progress.scope``, the attempt's own (``Progress``): an attempt enters
    no scope of the wire's.

    Raises:
        UpstreamError: the write or the head failed.
        trio.Cancelled: the head's deadline passed (``progress.scope`` catches it).
    """
    name = node.name
    header_timeout = request.head_timeout or config.response_header_timeout
    phase = "write"
    try:
        unsent = _write_at_once(stream, conn, request)
        if unsent:
            with trio.move_on_after(header_timeout) as write_scope:
                for part in unsent:
                    await stream.send_all(part)
            if write_scope.cancelled_caught:
                raise errors.HeaderTimeout(name, "write", f"request not taken in {header_timeout}s")
        written = trio.current_time()
        progress.waiting_since = written
        phase = "head"
        scope = progress.scope
        scope.deadline = written + head_wait(request, config)
        try:
            event = await next_event(stream, conn)
            while isinstance(event, h11.InformationalResponse):
                event = await next_event(stream, conn)
        finally:
            scope.deadline = math.inf  # lifted: the head's wait is over, whichever way
    except (trio.BrokenResourceError, OSError) as exc:
        if reused and phase == "write" and not sockopts.is_dead_peer_error(exc):
            raise _StaleConnection("broken on write") from exc
        raise map_error(name, phase, exc) from exc
    except (EarlyClose, h11.RemoteProtocolError, trio.ClosedResourceError) as exc:
        raise map_error(name, phase, exc) from exc
    if not isinstance(event, h11.Response):
        raise errors.UpstreamProtocolError(name, "head", f"unexpected {type(event).__name__}")
    return event, written


def head_wait(request: OutgoingRequest, config: Config) -> float:
    """How long after the request is written its whole head may take to come."""
    if request.unstreamed:
        return config.unstreamed_timeout
    return request.head_timeout or config.response_header_timeout


def head_timed_out(node: str, head_timeout: float) -> errors.HeaderTimeout:
    """The error of a head not complete ``head_timeout`` seconds after the request was written."""
    return errors.HeaderTimeout(node, "head", f"no complete response head in {head_timeout}s")


def _write_at_once(
    stream: trio.abc.Stream, conn: h11.Connection, request: OutgoingRequest
) -> list[bytes | memoryview]:
    """Frame the request and write what the kernel takes now; the parts left to send.

    Not a checkpoint: the parts left (none, nearly always) are sent under
    the write deadline.
    """
    # _parsed: skip h11's header regexes; OutgoingRequest documents why its
    # parts are valid already.
    head = conn.send(
        h11.Request(
            method=request.method, target=request.target, headers=request.headers, _parsed=True
        )
    )
    body = conn.send(h11.Data(data=request.body)) if request.body else b""
    end = conn.send(h11.EndOfMessage())
    if len(request.body) > RECEIVE_SIZE:  # do not copy a large body just to save a syscall
        return [head, body, end]
    data = head + body + end
    sent = http1.write_now(stream, data)
    if sent < 0:
        return [data]
    return [memoryview(data)[sent:]] if sent < len(data) else []


async def _error_body(
    name: str,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    response: h11.Response,
    action: HeadAction,
    config: Config,
) -> tuple[bytes, bool]:
    """Read a short error body; raise ``RetryableResponse`` if it means "fail over".

    The body must come within one more header duration (a node that sends
    "503" and stalls is still stalled). Returns the body and whether it is
    complete, to relay as the answer.
    """
    with (
        trio.move_on_after(config.response_header_timeout) as body_scope,
        mapped(name, "error body"),
    ):
        body_bytes, complete = await read_prefix(stream, conn, ERROR_BODY_LIMIT)
    if body_scope.cancelled_caught:
        raise errors.HeaderTimeout(name, "error body", "stalled after the head")
    not_found = complete and is_model_not_found(response.status_code, body_bytes)
    code = error_code(body_bytes, config.retry_error_codes) if complete else None
    if not not_found and not fails_over_on(action, code, config.retry_error_codes):
        return body_bytes, complete
    headers = list(response.headers)
    saved = (
        SavedResponse(
            node=name,
            status=response.status_code,
            reason=response.reason,
            headers=headers,
            body=body_bytes,
        )
        if complete
        else None
    )
    words = " model not found" if not_found else (f" {code}" if code else "")
    detail = f"answered {response.status_code}{words}"
    kind = errors.ModelNotFound if not_found else errors.RetryableResponse
    raise kind(name, "head", detail, response.status_code, headers, saved)


# The wait for a committing response's first body bytes (docs/failover.md):
# under ``first_body_timeout`` when the operator set one, else unbounded; in
# an event stream, up to its first line that is not a comment or blank, the
# pings before it held and given back with it.


async def _first_body(
    name: str, stream: trio.abc.Stream, conn: h11.Connection, config: Config
) -> tuple[bytes, bool]:
    """The first body bytes of a committing response.

    Unbounded unless the operator opted in (``first_body_timeout``), because
    a node may send its head at once and then prefill for minutes.
    """
    if not config.first_body_timeout:
        # ``mapped`` spelled out: the default path of every request, where a
        # generator-based context manager costs more than the read it wraps.
        try:
            return await read_body(stream, conn)
        except (EarlyClose, *IO_ERRORS) as exc:
            raise map_error(name, "first body byte", exc) from exc
    with trio.move_on_after(config.first_body_timeout), mapped(name, "first body byte"):
        return await read_body(stream, conn)
    # Only the deadline gets here.
    raise errors.FirstBodyTimeout(
        name, "first body byte", f"no body byte {config.first_body_timeout}s after head"
    )


async def _first_event(
    name: str, stream: trio.abc.Stream, conn: h11.Connection, config: Config, scanner: SseScanner
) -> tuple[bytes, bool]:
    """The first body bytes of an event stream, up to its first event line.

    Comment and blank lines (an engine's ``: ping`` during a long prefill)
    are held, not counted as the first body byte: the deadline runs on. The
    held bytes come back in front of the read with the first other line,
    unchanged. A body that ends or breaks with only such lines ended before
    its first byte (``UpstreamClosedEarly`` or the break's own error: next
    candidate, no cooldown). An empty body with a valid end commits, as any.
    """
    held: list[bytes] = []
    size = 0
    timeout = config.first_body_timeout
    with trio.move_on_after(timeout), mapped(name, "first body byte"):
        while True:
            chunk, complete = await read_body(stream, conn)
            if scanner.first_event_line(chunk) is not None:
                return b"".join([*held, chunk]) if held else chunk, complete
            if complete and not held and not chunk:
                return b"", True
            if complete:
                raise EarlyClose("the event stream ended with comments only")
            held.append(chunk)
            size += len(chunk)
            if size > HELD_LIMIT:
                raise errors.UpstreamProtocolError(
                    name, "first body byte", f"over {HELD_LIMIT} bytes of comments, no event"
                )
    raise errors.FirstBodyTimeout(
        name, "first body byte", f"no body byte {timeout}s after head (comments only)"
    )
