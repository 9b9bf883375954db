"""The fleet-wide model lists the client listener answers itself (docs/discovery.md).

- ``GET /v1/models``: from the configured ``models`` and the inventories at
  hand (``inventory.advertised_ids``, a down node's included: it is still a
  candidate); the nodes with neither are asked ``GET /v1/models`` now,
  unless they are down. ``inventory.models_document`` merges.
- ``GET /api/tags``: each node's answer to discovery's last check
  (``known_tags``), else it is
  asked ``GET /api/tags`` now, unless it is down; ``inventory.tags_document``
  merges.

Every live question is asked in parallel, with the connect timeout and
``LIST_ANSWER_TIMEOUT`` (2 s) for the whole answer, so a list answers
within about 2 s even with a frozen node: Open WebUI and similar clients
load it on every page. A node that fails, is late or gives no list is left
out; the answer is ``200`` while any node answered or was known, else
``502`` with a message that says what each node did (``failure_message``).
These questions are not attempts: no slot, no pool (``wire.fetch``).

Like every answer of the client listener, a list answer carries
``X-Request-Id`` (the client's, if valid, else a new one) and leaves one
access line (``Report.listed``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Sequence

import attrs
import h11
import trio

from ...core import errors
from ...core.answers import error_document, error_headers
from ...core.config import Config, LiveConfig, Upstream, live_config
from ...core.inventory import (
    CHECK_PATH,
    MAX_LISTING_BYTES,
    advertised_ids,
    models_document,
    needs_live_listing,
    parse_model_list,
    tags_document,
)
from ...core.requests import TAGS_PATH, workload_id
from ...telemetry.logs import logger
from ...wire.client import ClientConnection, ClientGone, ClientRequest
from ...wire.connect import Connector
from ...wire.fetch import fetch
from ..report import Report, log_listed
from .board import NodeBoard
from .queue import SlotQueue

LIST_ANSWER_TIMEOUT = 2.0  # per live question, after the connect
NO_LIST_CODE = "upstream_unavailable"

# Whether a 2xx body is a list of the route's kind.
_ListTest = Callable[[bytes], bool]
_ANSWERED = frozenset({"not_a_list"})  # results of a node that answered, not with a list


@attrs.frozen
class Asked:
    """What one node gave a list route that it was asked live, or why it was not asked.

    Attributes:
        node: its name.
        body: its ``2xx`` body when that is a list of the route's kind, else None.
        result: a short label for the access line (``listed``, ``timed_out``,
            ``connect_failed``, ``status_404``, ``not_a_list``, ``bad_answer``,
            ``broke_off``, ``down``).
        words: what it did, for the ``502``'s message ("" with a list).
    """

    node: str
    body: bytes | None
    result: str
    words: str = ""


@attrs.frozen
class Built:
    """A list document (None: nothing to list, ``502``) and the nodes asked for it."""

    document: dict[str, object] | None
    asked: tuple[Asked, ...]


def failure_message(path: str, asked: Iterable[Asked]) -> str:
    """The ``502``'s message: what each node left out did.

    ``no node serves /api/tags: a answered 404, b answered 404`` when every
    node answered (with another status, or a body that is no list; an
    Ollama client shows this text with the status), ``no node answered
    /v1/models: a did not answer in time, ...`` otherwise.
    """
    failed = [item for item in asked if item.body is None]
    if not failed:
        return f"no node answered {path}: none could be asked"
    answered = all(item.result in _ANSWERED or item.result.startswith("status_") for item in failed)
    lead = f"no node serves {path}" if answered else f"no node answered {path}"
    return lead + ": " + ", ".join(item.words for item in failed)


class FleetLists:
    """Builds and sends the two fleet-wide lists."""

    def __init__(
        self,
        config: Config | LiveConfig,
        connector: Connector,
        board: NodeBoard,
        queue: SlotQueue,
        report: Report,
    ) -> None:
        self._settings = live_config(config)
        self.connector = connector
        self.board = board
        self.queue = queue
        self.report = report
        # Per node asked, after the connect (2 s).
        self.answer_timeout = LIST_ANSWER_TIMEOUT
        # Each node's last live answer to GET /v1/models: what a node that is
        # busy now (not asked, below) still lists.
        self._listed: dict[str, Sequence[str]] = {}

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def forget(self, names: Iterable[str]) -> None:
        """Drop the last lists of nodes a reload added or removed (a new node starts afresh)."""
        for name in names:
            self._listed.pop(name, None)

    async def answer(
        self, client: ClientConnection, request: ClientRequest, client_name: str | None = None
    ) -> bool:
        """Answer a list route; returns keep-alive (as a workload's answer would).

        ``client_name``: the client key's name (``ClientGate``), for the access line.
        """
        started = trio.current_time()
        request_id = workload_id(request.headers)
        path = request.target.split(b"?", 1)[0]
        text = path.decode("ascii")
        built = await (self.tags() if path == TAGS_PATH else self.models())
        headers = [(b"x-request-id", request_id.encode())]
        document = built.document
        status = 200
        if document is None:
            status = 502
            message = failure_message(text, built.asked)
            document = error_document(text, status, NO_LIST_CODE, message)
            headers += error_headers(NO_LIST_CODE)
        sent = 0
        with contextlib.suppress(ClientGone, h11.LocalProtocolError):
            sent = await client.send_json(status, document, headers)
        nodes = [f"{item.node}:{item.result}" for item in built.asked]
        log_listed(request_id, text, client_name, status, nodes, started, sent)
        return client.reusable

    async def models(self) -> Built:
        """The fleet's ``/v1/models`` document, and the nodes asked live for it."""
        inventories = self.board.inventories
        # Not while an attempt of this proxy runs there: llama-cpp-python ends
        # a running generation for any request that needs its model, this
        # one included (as for the checks). Such a node lists
        # what it answered last time, if it ever did.
        ledger = self.queue.scheduler.ledger
        live = [
            node
            for node in self.config.upstreams
            if needs_live_listing(node.models, inventories.get(node.name))
            and ledger.in_flight(node.name) == 0
        ]
        asked = await self._ask_live(live, CHECK_PATH.encode(), _is_model_list, "model list")
        rows: list[tuple[str, Sequence[str] | None]] = []
        for node in self.config.upstreams:
            if node.name in asked:
                body = asked[node.name].body
                ids = None if body is None else parse_model_list(body).ids
                if ids is not None:
                    self._listed[node.name] = ids
                rows.append((node.name, ids))
            elif needs_live_listing(node.models, inventories.get(node.name)):
                rows.append((node.name, self._listed.get(node.name)))
            else:
                rows.append((node.name, advertised_ids(node.models, inventories.get(node.name))))
        return Built(models_document(rows), tuple(asked.values()))

    async def tags(self) -> Built:
        """The fleet's ``/api/tags`` document, and the nodes asked live for it."""
        known = {node.name: self.known_tags(node) for node in self.config.upstreams}
        live = [node for node in self.config.upstreams if known[node.name] is None]
        asked = await self._ask_live(live, TAGS_PATH, _is_tags_list, "tags list")
        bodies = [
            asked[node.name].body if node.name in asked else known[node.name]
            for node in self.config.upstreams
        ]
        return Built(tags_document(bodies), tuple(asked.values()))

    def known_tags(self, node: Upstream) -> bytes | None:
        """The node's last ``/api/tags`` answer from discovery, as a body, if any.

        A node with one is not asked live; None (discovery off, no check
        yet, or an engine without the route) has it asked now.
        """
        entries = self.board.known_tags(node.name)
        return None if entries is None else json.dumps({"models": entries}).encode()

    async def _ask_live(
        self, nodes: Sequence[Upstream], path: bytes, is_list: _ListTest, kind: str
    ) -> dict[str, Asked]:
        """Each node's answer to ``GET path``, asked in parallel; down nodes are not asked.

        In ``nodes``' order (ranking order), down nodes included as ``down``.
        """
        board = self.board
        asked: dict[str, Asked] = {}
        for node in nodes:  # placed first: the answers' order is the ranking's
            if board.is_down(node.name):
                asked[node.name] = Asked(node.name, None, "down", f"{node.name} is down")
            else:
                asked[node.name] = Asked(node.name, None, "pending")

        async def ask(node: Upstream) -> None:
            asked[node.name] = await self._ask(node, path, is_list, kind)

        async with trio.open_nursery() as nursery:
            for node in nodes:
                if asked[node.name].result == "pending":
                    nursery.start_soon(ask, node)
        return asked

    async def _ask(self, node: Upstream, path: bytes, is_list: _ListTest, kind: str) -> Asked:
        name = node.name
        try:
            answer = await fetch(
                node,
                path,
                connector=self.connector,
                config=self.config,
                answer_timeout=self.answer_timeout,
                limit=MAX_LISTING_BYTES + 1,
            )
        except errors.UpstreamError as exc:
            result, words = _failure_words(exc)
            logger.info("list: node left out", extra={"fields": {"node": name, "error": str(exc)}})
            return Asked(name, None, result, f"{name} {words}")
        status = answer.status
        if not 200 <= status < 300:
            logger.info("list: node left out", extra={"fields": {"node": name, "status": status}})
            return Asked(name, None, f"status_{status}", f"{name} answered {status}")
        if not answer.complete or not is_list(answer.body):
            words = f"{name} answered {status} without a {kind}"
            return Asked(name, None, "not_a_list", words)
        return Asked(name, answer.body, "listed")


def _is_model_list(body: bytes) -> bool:
    return parse_model_list(body).ids is not None


def _is_tags_list(body: bytes) -> bool:
    return tags_document([body]) is not None


def _failure_words(exc: errors.UpstreamError) -> tuple[str, str]:
    """The access-line label and the message's words for a question that got no answer."""
    if isinstance(exc, errors.ConnectFailed | errors.TLSError):
        return "connect_failed", "cannot be reached"
    if isinstance(exc, errors.ConnectTimeout | errors.HeaderTimeout):
        return "timed_out", "did not answer in time"
    if isinstance(exc, errors.UpstreamProtocolError):
        return "bad_answer", "did not answer in HTTP/1.1"
    return "broke_off", "closed the connection before its answer"
