"""The fleet-wide model lists the client listener answers itself (SPEC 5a).

- ``GET /v1/models``: from the configured ``models`` and the inventories at
  hand (``inventory.advertised_ids``); the nodes with neither are asked
  ``GET /v1/models`` now, in parallel. ``inventory.models_document`` merges.
- ``GET /api/tags``: every node is asked ``GET /api/tags`` now, in
  parallel; ``inventory.tags_document`` merges.

Each node asked gets the connect timeout plus ``CHECK_ANSWER_TIMEOUT``; one
that fails, times out or gives no list is left out, and so is a node that
is down (its last check could not reach it). ``502`` only when no node
answered. These requests are not attempts: no slot, no pool (``wire.fetch``).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ..core.answers import error_document
from ..core.config import Config, Upstream
from ..core.errors import UpstreamError
from ..core.inventory import (
    CHECK_ANSWER_TIMEOUT,
    CHECK_PATH,
    MAX_LISTING_BYTES,
    advertised_ids,
    models_document,
    needs_live_listing,
    parse_model_list,
    tags_document,
)
from ..telemetry.logs import logger
from ..wire.client import ClientConnection, ClientRequest
from ..wire.connect import Connector
from ..wire.fetch import fetch
from .report import Report

MODELS_PATH = b"/v1/models"
TAGS_PATH = b"/api/tags"


def is_list_route(request: ClientRequest) -> bool:
    """Whether the proxy answers this request itself (``GET /v1/models``, ``/api/tags``)."""
    if request.method != b"GET":
        return False
    return request.target.split(b"?", 1)[0] in (MODELS_PATH, TAGS_PATH)


class FleetLists:
    """Builds and sends the two fleet-wide lists."""

    def __init__(self, config: Config, connector: Connector, report: Report) -> None:
        self.config = config
        self.connector = connector
        self.report = report
        # Per node asked, after the connect (SPEC 5a: 10 s); tests shorten it.
        self.answer_timeout = CHECK_ANSWER_TIMEOUT

    async def answer(self, client: ClientConnection, request: ClientRequest) -> bool:
        """Answer a list route; returns keep-alive (as a workload's answer would)."""
        path = request.target.split(b"?", 1)[0]
        if path == TAGS_PATH:
            document = await self.tags()
        else:
            document = await self.models()
        if document is None:
            text = path.decode("ascii")
            document = error_document(text, 502, "upstream_unavailable", "no node answered")
            await client.send_json(502, document)
        else:
            await client.send_json(200, document)
        return client.reusable

    async def models(self) -> dict[str, object] | None:
        """The fleet's ``/v1/models`` document, or None when no node answered."""
        inventories = self.report.health.inventories
        reachable = self._reachable()
        live = [
            node
            for node in reachable
            if needs_live_listing(node.models, inventories.get(node.name))
        ]
        bodies = await self._ask_all(live, CHECK_PATH.encode())
        asked = {node.name for node in reachable}
        rows: list[tuple[str, Sequence[str] | None]] = []
        for node in self.config.upstreams:
            if node.name not in asked:
                rows.append((node.name, None))
            elif node.name in bodies:
                body = bodies[node.name]
                rows.append((node.name, None if body is None else parse_model_list(body).ids))
            else:
                rows.append((node.name, advertised_ids(node.models, inventories.get(node.name))))
        return models_document(rows)

    async def tags(self) -> dict[str, object] | None:
        """The fleet's ``/api/tags`` document, or None when no node gave one."""
        reachable = self._reachable()
        bodies = await self._ask_all(reachable, TAGS_PATH)
        return tags_document(bodies.get(node.name) for node in reachable)

    def _reachable(self) -> list[Upstream]:
        health = self.report.health
        return [node for node in self.config.upstreams if not health.is_down(node.name)]

    async def _ask_all(self, nodes: Sequence[Upstream], path: bytes) -> dict[str, bytes | None]:
        """Each node's ``2xx`` body for ``GET path``, asked in parallel (None: no answer)."""
        bodies: dict[str, bytes | None] = {}

        async def ask(node: Upstream) -> None:
            bodies[node.name] = await self._ask(node, path)

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(ask, node)
        return bodies

    async def _ask(self, node: Upstream, path: bytes) -> bytes | None:
        try:
            answer = await fetch(
                node,
                path,
                connector=self.connector,
                config=self.config,
                answer_timeout=self.answer_timeout,
                limit=MAX_LISTING_BYTES + 1,
            )
        except UpstreamError as exc:
            logger.info(
                "list: node left out", extra={"fields": {"node": node.name, "error": str(exc)}}
            )
            return None
        if not 200 <= answer.status < 300 or not answer.complete:
            fields = {"node": node.name, "status": answer.status}
            logger.info("list: node left out", extra={"fields": fields})
            return None
        return answer.body
