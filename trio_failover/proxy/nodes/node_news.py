"""What the proxy tells of a node's readiness changing: events, log lines, gauges.

``NodeNews`` is a listener of the node board (``board.py``): each
``NodeChange`` it is handed becomes the ``node`` event (``cooling``,
``ready``, ``down``), its log line and the node gauges (``gauge_nodes``:
the counts of cooling and down nodes, and the node's own state). A record
for one model of a node serving several is a ``node`` event with its
``model`` (a node-wide event has none), a log line and
``trio_failover_model_cooldowns``; the node gauges count whole nodes only.
It writes no node state.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from ...core.node_change import ChangeKind, NodeChange
from ...telemetry.events import EventBus
from ...telemetry.logs import logger
from ...telemetry.metrics import Metrics
from .board import NodeBoard


class NodeNews:
    """Turns the board's changes into events, log lines and gauges."""

    def __init__(self, board: NodeBoard, events: EventBus, metrics: Metrics) -> None:
        self.board = board
        self.events = events
        self.metrics = metrics

    def __call__(self, change: object) -> None:
        if not isinstance(change, NodeChange):  # a check's or an engine's: no news
            return
        node, reason, kind = change.node, change.reason, change.kind
        metrics = self.metrics
        if change.model is not None:
            self._model_news(change)
            return
        if kind is ChangeKind.COOLING:
            metrics.child(metrics.cooldowns, node, reason).inc()
            until = round(change.remaining, 3)
            fields = {"node": node, "reason": reason, "for_s": until}
            logger.warning("cooldown", extra={"fields": fields})
            self._publish(node, "cooling", reason, until)
        elif kind is ChangeKind.READY:
            logger.info("node ready", extra={"fields": {"node": node, "reason": reason}})
            self._publish(node, "ready", reason, 0)
        elif kind is ChangeKind.DOWN:
            fields = {"node": node, "reason": reason, "error": change.error}
            logger.warning("node down", extra={"fields": fields})
            self._publish(node, "down", reason, 0)
        gauge_nodes(self.board, metrics, (node,), trio.current_time())

    def _model_news(self, change: NodeChange) -> None:
        """A change of one model's cooldown on a node: its event, log line and counter."""
        node, model, reason = change.node, change.model, change.reason
        fields = {"node": node, "model": model, "reason": reason}
        if change.kind is ChangeKind.COOLING:
            metrics = self.metrics
            assert model is not None
            metrics.child(metrics.model_cooldowns, node, model, reason).inc()
            until = round(change.remaining, 3)
            logger.warning("model cooldown", extra={"fields": {**fields, "for_s": until}})
            self._publish(node, "cooling", reason, until, model)
        elif change.kind is ChangeKind.READY:
            logger.info("model ready", extra={"fields": fields})
            self._publish(node, "ready", reason, 0, model)

    def _publish(
        self, node: str, state: str, reason: str, until: float, model: str | None = None
    ) -> None:
        event = {"type": "node", "node": node, "state": state, "reason": reason, "until_s": until}
        if model is not None:  # one model's cooldown; else the whole node's
            event["model"] = model
        self.events.publish(event)


def node_state(board: NodeBoard, node: str, now: float) -> str | None:
    """``node``'s state as ``/status`` names it (None: no longer configured).

    Down is the graver news: a node whose last check failed is down even
    while a cooldown runs.
    """
    if node not in board.configured:
        return None
    if board.is_down(node):
        return "down"
    return "cooling" if board.cooldown(node, now) is not None else "ready"


def gauge_nodes(board: NodeBoard, metrics: Metrics, nodes: Iterable[str], now: float) -> None:
    """Set the node gauges from the board: the cooling and down counts, ``nodes``' states.

    A node no longer configured (a reload removed it) is in none of the states.
    """
    metrics.cooling.set(len(board.cooldowns.active(now)))
    metrics.down.set(board.down_count())
    for node in nodes:
        metrics.node_is(node, node_state(board, node, now))
