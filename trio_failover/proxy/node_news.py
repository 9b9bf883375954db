"""What the proxy tells of a node's readiness changing: events, log lines, gauges.

``NodeNews`` is a listener of the node board (``board.py``): each
``NodeChange`` it is handed becomes the ``node`` event (``cooling``,
``ready``, ``down``; SPEC 8), its log line and the gauges of cooling and
down nodes. It writes no node state.
"""

from __future__ import annotations

import trio

from ..core.node_change import ChangeKind, NodeChange
from ..telemetry.events import EventBus
from ..telemetry.logs import logger
from ..telemetry.metrics import Metrics
from .board import NodeBoard


class NodeNews:
    """Turns the board's changes into events, log lines and gauges."""

    def __init__(self, board: NodeBoard, events: EventBus, metrics: Metrics) -> None:
        self.board = board
        self.events = events
        self.metrics = metrics

    def __call__(self, change: NodeChange) -> None:
        node, reason, kind = change.node, change.reason, change.kind
        metrics = self.metrics
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
        if kind is not ChangeKind.DOWN and change.model is None:
            metrics.cooling.set(len(self.board.cooldowns.active(trio.current_time())))
        if kind is not ChangeKind.COOLING:
            metrics.down.set(self.board.down_count())

    def _publish(self, node: str, state: str, reason: str, until: float) -> None:
        self.events.publish(
            {"type": "node", "node": node, "state": state, "reason": reason, "until_s": until}
        )
