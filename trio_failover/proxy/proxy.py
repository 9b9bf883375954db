"""The failover proxy: client connections in, workloads out to the nodes.

``Proxy`` wires the parts together and is what embedders, ``server.serve``,
the admin API and the demo hold: the client connection (``wire.client``),
the client-key check every request passes first (``ClientGate``, here),
one ``WorkloadRunner`` per proxy (``workload.py``), the node board
(``board.py``: every node's state, and its only writer), the slot queue
(``queue.py``) and the telemetry (``report.py``). The queue's dispatch and
the node events (``node_news.py``) listen to the board.

The proxy owns its life: ``Proxy.run`` (``async with proxy``, or
``open_proxy``) runs its own tasks in a nursery of its own — the cooldown
ticker, the pool's watcher, the streams' silence watch, the checks of
discovery and the engines' reader — and closes its pooled connections when
it ends. A proxy serves only while they run: nothing in it has a mode
without them; whatever ends them, its pooled connections close.

A proxy nobody runs still serves a connection handed to it
(``Proxy(config, connector=...)`` serves any stream): ``lent`` runs its
tasks, without discovery, in the task of the first such connection, for as
long as any connection so served lasts (the first one's task waits for the
others before it stops them).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import attrs
import h11
import trio

from ..core.answers import error_document, error_headers
from ..core.auth import Keys, check_client, forwarded_headers
from ..core.config import Config, LiveConfig
from ..core.cooldown import CooldownTable
from ..core.engine_book import EngineBook, engine_settings
from ..core.headers import get
from ..core.redis_url import parse_state
from ..core.requests import is_list_route, workload_id
from ..core.sharing import ANONYMOUS, client_from_header
from ..telemetry.events import EventBus
from ..telemetry.metrics import Metrics
from ..wire.client import ClientConnection, ClientGone, ClientRequest, Drain
from ..wire.pool import ConnectionPool
from ..wire.upstream import Connector, TCPConnector
from .nodes.affinity import CacheAffinity
from .nodes.board import NodeBoard, NodeState
from .nodes.discovery import Discovery
from .nodes.engine_reader import EngineReader
from .nodes.lists import FleetLists
from .nodes.liveness import LivenessChecker
from .nodes.node_news import NodeNews
from .nodes.queue import SlotQueue, gauge_in_flight
from .nodes.silence import SilenceWatch
from .nodes.status import StatusView
from .nodes.ticker import EXPIRY_TICK, expire_cooldowns_every
from .reload import ReloadResult, apply_reload
from .report import Report
from .request.workload import WorkloadRunner

if TYPE_CHECKING:
    from .fleet.fleet import Fleet

__all__ = ["Proxy", "open_proxy"]

# ``/status``'s ``state`` with ``--state memory``: this process alone.
MEMORY_STATE = {"backend": "memory", "connected": True, "replicas": 1}


class Proxy:
    """The failover proxy, independent of how client connections arrive.

    ``await proxy.handle_connection(stream)`` serves one client connection on
    any ``trio.abc.Stream``; ``server.serve`` feeds it accepted sockets, tests
    feed it in-memory streams (with a ``testing.MemoryConnector`` upstream).
    It serves only while its own tasks run: inside ``async with proxy:``
    (or ``open_proxy``), or while ``await nursery.start(proxy.run)`` runs.
    """

    def __init__(self, config: Config, *, connector: Connector | None = None) -> None:
        # The running configuration: the one holder every part reads at use;
        # a reload replaces ``live.config`` and nothing else (reload.py).
        self.live = live = LiveConfig(config)
        self.connector: Connector = connector or TCPConnector(config)
        # Idle keep-alive connections to nodes; close with ``pool.aclose()``.
        self.pool = ConnectionPool(
            max_idle=config.pool_max_idle, idle_timeout=config.pool_idle_timeout
        )
        self.report = Report(live)
        self.board, self.queue = _board_and_queue(config, self.report)
        self.view = StatusView(
            live,
            self.board,
            self.queue,
            self.report.recent,
            self.report.live,
            self.report.limits_hit,
        )
        metrics = self.report.metrics
        self.pool.on_stray = lambda node: metrics.child(metrics.stray_bytes, node).inc()
        self._drain = Drain()
        self._gate = ClientGate(live, self.report)
        # Every wait for a node, timed by ``silence.watch`` (``run``): the
        # streams' idle timeouts, and the questions of a silent node.
        self.silence = SilenceWatch(live)
        # GET /health of a node a wait has found silent; with discovery on or off.
        self.liveness = LivenessChecker(live, self.connector, self.board, self.report, self.silence)
        self.silence.ask = self.liveness.ask
        self.silence.down_because = self.board.down_because
        # A node marked down, by any check, ends every wait on it.
        self.board.listen(self.silence.board_changed)
        # The engines' signals: read by engine_reader, kept by the
        # board (``engines``), read by the slot ledger and the attempts.
        board = self.board
        self.engine_reader = EngineReader(
            live,
            self.connector,
            lambda read: board.apply(read, trio.current_time()),
        )
        self._workloads = WorkloadRunner(
            live,
            self.connector,
            self.pool,
            self.board,
            self.queue,
            self.report,
            self.silence,
            self.board.engines,
        )
        # Cache affinity's memory of what each node served (docs/capacity.md).
        self.affinity = CacheAffinity(metrics)
        self._workloads.attempts.affinity = self.view.affinity = self.affinity
        # The fleet's GET /v1/models and /api/tags, and the checks (docs/discovery.md).
        self.lists = FleetLists(live, self.connector, self.board, self.queue, self.report)
        self.discovery = Discovery(
            live,
            self.connector,
            self.board,
            self.queue,
            self.report,
            on_checked=self.engine_reader.checked,
            moving=self.silence.moving,
        )
        # The replicas' shared state (docs/replicas.md): None with ``--state memory``.
        self.fleet: Fleet | None = None
        if parse_state(config.state) is not None:
            from .fleet.fleet import Fleet  # only then: it pulls in the Redis client

            self.fleet = Fleet(config, self.board, self.queue, self.affinity)
            self._workloads.attempts.fleet = self.fleet.slots
            self._workloads.shares.fleet = self.fleet.state  # rpm and tpm fleet-wide
            self.report.share_usage = self.fleet.usage.told  # GET /usage fleet-wide
        metrics.read_state(self._state_status)
        # Its own tasks' lifetime (``run``, ``async with``, ``lent``).
        self._running = False
        self._lifetime: trio.Nursery | None = None  # ``async with``'s nursery
        self._lifetime_manager: Any = None
        self._lent_to = 0  # connections served while ``lent`` runs the tasks
        self._lent_over: trio.Event | None = None  # set when the last of them ended

    @property
    def config(self) -> Config:
        """The running configuration (``live.config``), read at use."""
        return self.live.config

    @property
    def engines(self) -> EngineBook:
        """The nodes' engines as last read (``engine_book.EngineBook``); the board's."""
        return self.board.engines

    @property
    def cooldowns(self) -> CooldownTable:
        """The nodes' cooldown table (``cooldown.CooldownTable``); read it, change the board."""
        return self.board.cooldowns

    @property
    def events(self) -> EventBus:
        """Workload and node events; ``subscribe()`` to follow them."""
        return self.report.events

    @property
    def metrics(self) -> Metrics:
        """The Prometheus metrics of this proxy."""
        return self.report.metrics

    @property
    def stats(self) -> dict[str, NodeState]:
        """Each node's state and counters, as ``/status`` shows them (the board's)."""
        return self.board.nodes

    @property
    def recent(self) -> list[dict[str, Any]]:
        """The last finished workloads, oldest first, in their ``/status`` form."""
        return self.view.recent()

    @property
    def draining(self) -> bool:
        """Whether ``begin_drain`` was called."""
        return self._drain.active

    @property
    def running(self) -> bool:
        """Whether its own tasks run (``run``, ``async with``): it may serve."""
        return self._running

    # -- its own tasks' lifetime ---------------------------------------------------------

    async def run(
        self,
        *,
        discovery: bool = True,
        task_status: trio.TaskStatus[Self] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the proxy's own tasks until cancelled, then close its pooled connections.

        ``proxy = await nursery.start(Proxy(config).run)`` gives the proxy
        once they run: the cooldown ticker (``ticker.py``), the pool's
        watcher (of idle connections), the watch of every committed stream's
        ``--stream-idle-timeout`` (``silence.py``), discovery and the engines'
        reader.

        Args:
            discovery: False: no checks and no engine reads whatever the
                settings say (``testing.start_in_fleet``: fake nodes see
                only the test's requests).
            task_status: receives the proxy once its tasks run.

        Cancellation: the pool is closed even so. Stop it only after the
        connections it serves ended: a relaying stream loses its idle timer.

        Raises:
            RuntimeError: it runs already.
        """
        if self._running:
            raise RuntimeError("this Proxy runs already")
        try:
            async with trio.open_nursery() as nursery:
                await self._start_own_tasks(nursery, discovery=discovery)
                self._running = True
                task_status.started(self)
        finally:
            self._running = False
            # Shielded, briefly: a close cut by our own cancellation leaks sockets.
            with trio.move_on_after(1.0, shield=True):
                await self.pool.aclose()

    async def __aenter__(self) -> Self:
        """Run the proxy's own tasks (``run``) until the block ends."""
        manager = trio.open_nursery()
        nursery = await manager.__aenter__()
        try:
            await nursery.start(self.run)
        except BaseException as exc:
            await manager.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._lifetime, self._lifetime_manager = nursery, manager
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        nursery, manager = self._lifetime, self._lifetime_manager
        assert nursery is not None, "__aexit__ without __aenter__"
        self._lifetime = self._lifetime_manager = None
        nursery.cancel_scope.cancel()
        # The block's exception leaves unwrapped: the nursery (the proxy's
        # tasks only; a failure of theirs still comes out) is told of none.
        await manager.__aexit__(None, None, None)
        return False

    @asynccontextmanager
    async def lent(self) -> AsyncIterator[None]:
        """Serve one connection of a proxy nobody runs: its tasks run meanwhile.

        The first connection runs them (``run`` without discovery: as a
        bare proxy has always served, checking nothing of its own accord);
        later ones share them; the first one's block ends only after the
        last one's did, then the tasks stop and the pool closes.
        """
        if self._lent_over is not None:  # tasks lent already: share them
            self._lent_to += 1
            try:
                yield
            finally:
                self._lent_to -= 1
                if not self._lent_to:
                    self._lent_over.set()
            return
        over = self._lent_over = trio.Event()
        self._lent_to = 1
        manager = trio.open_nursery()
        nursery = await manager.__aenter__()
        try:
            await nursery.start(functools.partial(self.run, discovery=False))
            try:
                yield
            finally:
                self._lent_to -= 1
                if self._lent_to:
                    await over.wait()
        finally:
            self._lent_over = None
            nursery.cancel_scope.cancel()
            await manager.__aexit__(None, None, None)

    async def _start_own_tasks(self, nursery: trio.Nursery, *, discovery: bool) -> None:
        """Start the tasks ``run`` runs."""
        nursery.start_soon(expire_cooldowns_every, self.board, self.queue, EXPIRY_TICK)
        nursery.start_soon(self.pool.watch)
        nursery.start_soon(self.silence.watch)
        nursery.start_soon(self.report.metrics.share_every)  # --workers only; else returns
        await nursery.start(self.liveness.run)
        if self.fleet is not None:  # joined (or tried once) before the checks begin
            await nursery.start(self.fleet.run)
        if discovery:
            await nursery.start(self.discovery.run)  # returns at once when off
            await nursery.start(self.engine_reader.run)  # likewise

    async def handle_connection(
        self, stream: trio.abc.Stream, *, client_address: str | None = None, scheme: str = "http"
    ) -> None:
        """Serve one client connection until it closes; closes ``stream``.

        On a proxy that does not run (``run``, ``async with``), its tasks
        run while the connection lasts (``lent``).
        """
        if not self._running or self._lent_over is not None:
            async with self.lent():
                await self._serve(stream, client_address, scheme)
            return
        await self._serve(stream, client_address, scheme)

    async def _serve(
        self, stream: trio.abc.Stream, client_address: str | None, scheme: str
    ) -> None:
        config = self.config
        client = ClientConnection(
            stream,
            max_head=config.max_request_head,
            max_body=config.max_request_body,
            client_header_timeout=config.client_header_timeout,
            keepalive_timeout=config.keepalive_timeout,
            drain=self._drain,
            admit=self._gate.allows if self._gate.checks else None,
        )

        async def handler(client: ClientConnection, request: ClientRequest) -> bool:
            # Every request of the client listener passes the key check
            # first, whatever route answers it.
            admitted = await self._gate.admit(client, request)
            if admitted is None:
                return client.reusable
            request = admitted.request
            if is_list_route(request.method, request.target):  # the fleet's lists, answered here
                return await self.lists.answer(client, admitted.request, admitted.client)
            return await self._workloads.run(
                client, admitted.request, client_address, scheme, client_name=admitted.client
            )

        await client.serve(handler)

    def known_tags(self, node: str) -> list[dict[str, object]] | None:
        """The ``models`` entries of ``node``'s last ``/api/tags`` answer to a check.

        None while it has given none (discovery off, not asked yet, or an
        engine without the route); see ``NodeBoard.known_tags``.
        """
        return self.board.known_tags(node)

    def begin_drain(self) -> None:
        """Stop taking new requests: idle keep-alive connections close now.

        Workloads waiting in the queue get ``503`` ``shutting_down`` at once
        (nothing was sent for them); those holding a slot run on.
        """
        self._drain.begin()
        self.queue.close()

    def expire_cooldowns(self, now: float | None = None) -> None:
        """Notice cooldowns that ran out (publishing ``ready`` node events)."""
        self.board.expire(trio.current_time() if now is None else now)

    async def reload(
        self, config: Config, *, tls_files_changed: bool = False, dry_run: bool = False
    ) -> ReloadResult:
        """Take a new configuration for new attempts; running workloads keep their node.

        Refused (nothing changes, ``ok`` False) when a setting that needs
        a restart differs (a listener address, ...). Every reload but a
        ``dry_run`` logs what it changed and publishes a ``reload`` event.
        See ``reload.py`` for what each part does with it.
        """
        return await apply_reload(
            self, config, tls_files_changed=tls_files_changed, dry_run=dry_run
        )

    def status(self) -> dict[str, Any]:
        """The ``GET /status`` document."""
        document = self.view.document()
        now = trio.current_time()
        for node in document["nodes"]:  # the engine: kind, capacity source, last reading
            node.update(self.engines.describe(node["name"], now))
        document["state"] = self._state_status()
        return document

    async def usage(self) -> dict[str, Any]:
        """The ``GET /usage`` document: every client's use, per model.

        With a shared state, the fleet's (every replica's counts, added up
        in Redis); while Redis does not answer, this replica's own.
        """
        if self.fleet is None:
            return self.report.usage.document(trio.current_time())
        return await self.fleet.usage.document(self.report.usage)

    def _state_status(self) -> dict[str, Any]:
        """``/status``'s ``state``: ``{"backend", "connected", "replicas"}``."""
        return dict(MEMORY_STATE) if self.fleet is None else self.fleet.status()


REFUSAL_MESSAGE = "missing or invalid API key"


@attrs.frozen
class Admitted:
    """A request that may go on, as which client, with its credentials removed."""

    request: ClientRequest
    client: str  # the key's NAME; without keys the client header's value, else "anonymous"


class ClientGate:
    """The client listener's key check (docs/security.md), before anything else of a request.

    ``Proxy.handle_connection``'s handler passes every request through
    ``admit`` first, so that no route of the client listener (the
    workloads, and any the proxy answers itself) is reachable without a key
    while keys are configured. The decisions are ``core.auth``'s; the gate
    answers the ``401`` and takes the client's credentials off the request
    before it goes any further. The keys are the running configuration's,
    read at use: a reload's new keys hold from the next request on.
    """

    def __init__(self, live: LiveConfig, report: Report) -> None:
        self.live = live
        self.report = report

    @property
    def keys(self) -> Keys:
        """The configured ``(name, key)`` pairs; empty when none is configured."""
        return tuple(
            (client.name, client.key)
            for client in self.live.config.clients
            if client.key is not None
        )

    @property
    def checks(self) -> bool:
        """Whether keys are configured (and so checked)."""
        return bool(self.live.config.keyed_clients)

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request head presents a configured key.

        ``ClientConnection``'s ``admit``: the body of a refused request is
        read and dropped, never buffered.
        """
        # A reload may have removed every key since the connection opened.
        keys = self.keys
        return not keys or check_client(headers, keys).allowed

    async def admit(self, client: ClientConnection, request: ClientRequest) -> Admitted | None:
        """The request to serve, or None after answering it ``401`` (keep-alive kept).

        Nothing of a refused request goes upstream, and nothing of what it
        presented is logged: the access line names no key, right or wrong.
        """
        keys = self.keys
        if not keys:  # nothing checked, nothing removed
            header = self.live.config.client_header
            if header is None:
                return Admitted(request, ANONYMOUS)
            name = client_from_header(get(request.headers, header.lower().encode("ascii")))
            if name is None:
                await self._bad_client(client, request, header)
                return None
            return Admitted(request, name)
        check = None if request.refused else check_client(request.headers, keys)
        if check is None or not check.allowed:
            await self._refuse(client, request)
            return None
        # The client's Authorization and X-Api-Key were the proxy's key: a
        # node gets only its own configured headers.
        stripped = attrs.evolve(request, headers=forwarded_headers(request.headers, keys))
        return Admitted(stripped, check.name or ANONYMOUS)

    async def _refuse(self, client: ClientConnection, request: ClientRequest) -> None:
        started = trio.current_time()
        path, request_id, sent = await _answer_refused(
            client, request, 401, "invalid_api_key", REFUSAL_MESSAGE
        )
        self.report.unauthorized(
            request_id, request.method.decode("ascii", "replace"), path, started, sent
        )

    async def _bad_client(
        self, client: ClientConnection, request: ClientRequest, name: str
    ) -> None:
        """Answer ``400``: the client header names no valid client (nothing goes further)."""
        started = trio.current_time()
        message = f"{name} must be 1-128 characters of A-Z a-z 0-9 . _ : @ -"
        path, request_id, sent = await _answer_refused(
            client, request, 400, "invalid_client", message
        )
        self.report.unauthorized(
            request_id, request.method.decode("ascii", "replace"), path, started, sent, status=400
        )


async def _answer_refused(
    client: ClientConnection, request: ClientRequest, status: int, code: str, message: str
) -> tuple[str, str, int]:
    """The gate's own JSON error; returns the path, the request id and the bytes sent."""
    path = request.target.split(b"?", 1)[0].decode("ascii", "replace")
    request_id = workload_id(request.headers)
    document = error_document(path, status, code, message)
    headers = [*error_headers(code), (b"x-request-id", request_id.encode())]
    sent = 0
    with contextlib.suppress(ClientGone, h11.LocalProtocolError):
        sent = await client.send_json(status, document, headers)
    return path, request_id, sent


def _board_and_queue(config: Config, report: Report) -> tuple[NodeBoard, SlotQueue]:
    """The node board and the slot queue, and what listens to the board.

    The queue's dispatch hears its readiness changes and engine readings,
    the node news (events, logs, gauges) its readiness changes.
    """
    board = NodeBoard(node.name for node in config.upstreams)
    queue = SlotQueue(config, board.is_demoted, board.model_cooldowns)
    gauge_in_flight(report.metrics, board.configured, queue)
    report.metrics.queue_length.set_function(queue.__len__)
    board.listen(queue.board_changed)
    board.listen(NodeNews(board, report.events, report.metrics))
    board.configure_engines(engine_settings(config))
    queue.scheduler.ledger.signals = board.engines.signals
    return board, queue


@asynccontextmanager
async def open_proxy(config: Config, *, connector: Connector | None = None) -> AsyncIterator[Proxy]:
    """A ``Proxy`` whose own tasks run for the block (``async with Proxy(...)``).

    Args:
        config: the settings.
        connector: how to reach nodes (default: TCP/TLS).
    """
    async with Proxy(config, connector=connector) as proxy:
        yield proxy
