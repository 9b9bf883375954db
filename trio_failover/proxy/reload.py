"""A reload in the shell: a running ``Proxy`` takes a new ``Config`` (docs/configuration.md).

``core/reload.py`` says what changes and what is refused; ``apply_reload``
carries a diff without refusals out, in an order that cannot half-apply:
first what may fail (the nodes' TLS contexts), then the swaps, which
cannot. How each part takes the new configuration:

- read at use, from their ``config`` attribute, swapped here in one pass
  (``_swap_config``): ``Proxy`` (a new client connection's limits and
  timeouts), ``Report`` and its ``StatusView`` (``/status``), the workload
  runner with its ``Attempts``, ``Milestones`` and ``Relay`` (candidates,
  timeouts, ``client_close``), ``LivenessChecker``, ``FleetLists``, the
  ``ClientGate`` (the client keys);
- ``TCPConnector``: its TLS contexts built for the new nodes (a bad
  ``ca_file`` refuses the reload before anything changed) and its
  dead-peer timeout;
- ``SlotQueue``: the capacities, balance and queue length; a lowered
  capacity lets no new attempt in until the node is under it; when the
  node list changed, the waiting workloads resolve their candidates again
  (a removed node's waiters go elsewhere, or get their answer);
- ``ConnectionPool``: its limits; the idle connections of removed nodes,
  and of nodes whose URL or TLS changed, are closed;
- ``Discovery``: checks the added nodes, stops checking the removed ones;
- the node state (cooldowns, down flags, inventories, counters, the
  liveness checks' books, the metrics' series): ``_reconcile_node_state``,
  the one function that knows where it lives.

Running workloads keep the ``Upstream`` they hold: their attempt, and the
stream after it, end where they began.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from ..core.config import Config, LiveConfig
from ..core.engine_book import engine_settings
from ..core.errors import ConfigError
from ..core.reload import diff_configs
from ..telemetry.logs import logger
from ..wire.connect import TCPConnector
from .nodes.node_news import gauge_nodes
from .nodes.queue import gauge_in_flight

if TYPE_CHECKING:
    from ..telemetry.events import EventBus
    from ..wire.pool import ConnectionPool
    from ..wire.upstream import Connector
    from .nodes.board import NodeBoard
    from .nodes.discovery import Discovery
    from .nodes.engine_reader import EngineReader
    from .nodes.lists import FleetLists
    from .nodes.liveness import LivenessChecker
    from .nodes.queue import SlotQueue
    from .nodes.silence import SilenceWatch
    from .nodes.status import StatusView
    from .report import Report
    from .request.workload import WorkloadRunner


class Proxy(Protocol):
    """The parts of ``proxy.Proxy`` a reload touches (named here: proxy.py imports this)."""

    live: LiveConfig
    connector: Connector
    pool: ConnectionPool
    report: Report
    board: NodeBoard
    view: StatusView
    queue: SlotQueue
    engine_reader: EngineReader
    liveness: LivenessChecker
    silence: SilenceWatch
    lists: FleetLists
    discovery: Discovery
    _workloads: WorkloadRunner

    @property
    def config(self) -> Config: ...

    @property
    def events(self) -> EventBus: ...


__all__ = ["ReloadResult", "apply_reload", "failed_reload"]


@attrs.frozen
class ReloadResult:
    """What a reload did: applied (``ok``) with its ``changes``, or not and why (``error``)."""

    ok: bool
    changes: tuple[str, ...] = ()
    error: str | None = None

    def event(self) -> dict[str, Any]:
        """The ``reload`` event."""
        return {"type": "reload", "ok": self.ok, "changes": list(self.changes), "error": self.error}


def failed_reload(proxy: Proxy, error: str, *, logged: int = 0) -> ReloadResult:
    """Tell of a reload that changes nothing: its log line and its ``reload`` event.

    ``logged``: ``error`` is already in the log, in that many lines (an
    invalid file's mistakes, as ``serve`` prints them at startup); the
    refusal's own line then counts them rather than saying each twice.
    """
    result = ReloadResult(False, (), error)
    fields: dict[str, object] = {"mistakes": logged} if logged else {"error": error}
    logger.error("reload refused", extra={"fields": fields})
    proxy.events.publish(result.event())
    proxy.report.metrics.reloaded(False)
    return result


async def apply_reload(
    proxy: Proxy, new: Config, *, tls_files_changed: bool = False, dry_run: bool = False
) -> ReloadResult:
    """Make ``new`` the running configuration of ``proxy``, or say why not.

    ``dry_run``: only say what it would change (no log line, no event).
    """
    diff = diff_configs(proxy.config, new, tls_files_changed=tls_files_changed)
    if dry_run:
        return ReloadResult(diff.ok, tuple(diff.changes()), "; ".join(diff.refused) or None)
    if not diff.ok:
        return failed_reload(proxy, "; ".join(diff.refused))
    connector = proxy.connector
    if isinstance(connector, TCPConnector):
        try:
            connector.reconfigure(new)  # may refuse: a CA file that cannot be loaded
        except ConfigError as exc:
            return failed_reload(proxy, str(exc))
    old = proxy.config
    _swap_config(proxy, new)
    _reconcile_node_state(proxy, old, new)
    proxy.queue.reconfigure(new, moved=diff.nodes_changed)
    restart = {change.name for change in diff.changed if change.reconnects}
    if old.discovery_interval != new.discovery_interval:
        restart |= {node.name for node in new.upstreams}
    proxy.discovery.reconcile(new, restart)
    await _close_idle(proxy, set(diff.removed) | restart)
    result = ReloadResult(True, tuple(diff.changes()))
    logger.info("reloaded", extra={"fields": {"changes": list(result.changes) or "none"}})
    proxy.events.publish(result.event())
    proxy.report.metrics.reloaded(True)
    return result


def _swap_config(proxy: Proxy, new: Config) -> None:
    """Every part that reads the configuration at use gets the new one."""
    proxy.live.config = new  # every part reads it at use: this is the whole swap
    pool = proxy.pool
    pool.max_idle, pool.idle_timeout = new.pool_max_idle, new.pool_idle_timeout
    # A stream still running at a node a reload moved (URL, TLS) or removed
    # does not give its connection back to the pool when it ends.
    pool.origins = {node.name: node for node in new.upstreams}


def _reconcile_node_state(proxy: Proxy, old: Config, new: Config) -> None:
    """The nodes' state after a reload: fresh for added nodes, kept for kept ones.

    The board keeps it (``NodeBoard.reconcile``: a removed node's entry
    stays while the workloads still running there write their outcome);
    here the parts outside it follow: liveness books, the fleet lists'
    cache, the metric series, the engines' state and readers.
    """
    before = {node.name for node in old.upstreams}
    added = [node.name for node in new.upstreams if node.name not in before]
    after = {node.name for node in new.upstreams}
    board = proxy.board
    board.reconcile(node.name for node in new.upstreams)
    proxy.liveness.reconcile(added)
    proxy.board.configure_engines(engine_settings(new))
    proxy.engine_reader.reconcile(new)  # its readers follow (URL, TLS, engine, intervals)
    proxy.lists.forget([*added, *(before - after)])
    metrics = proxy.report.metrics
    metrics.declare_nodes(added)
    gauge_in_flight(metrics, added, proxy.queue)
    gauge_nodes(board, metrics, before | after, trio.current_time())


async def _close_idle(proxy: Proxy, nodes: set[str]) -> None:
    for name in sorted(nodes):
        await proxy.pool.aclose(name)
