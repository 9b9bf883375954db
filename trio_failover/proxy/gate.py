"""The client listener's key check (docs/security.md), before anything else of a request.

``Proxy.handle_connection`` passes every request through ``ClientGate.admit``
first, so that no route of the client listener (the workloads, and any the
proxy answers itself) is reachable without a key while keys are configured.
The decisions are ``core.auth``'s; this module answers the ``401`` and takes
the client's credentials off the request before it goes any further.
"""

from __future__ import annotations

import contextlib

import attrs
import h11
import trio

from ..core.answers import error_document, error_headers
from ..core.auth import check_client, forwarded_headers
from ..core.config import Config
from ..core.requests import workload_id
from ..wire.client import ClientConnection, ClientGone, ClientRequest
from .report import Report

REFUSAL_MESSAGE = "missing or invalid API key"


@attrs.frozen
class Admitted:
    """A request that may go on, as which client, with its credentials removed."""

    request: ClientRequest
    client: str | None  # the key's NAME; None when no key is configured


class ClientGate:
    """Checks each request's key against the configured client keys."""

    def __init__(self, config: Config, report: Report) -> None:
        self.keys = tuple((client.name, client.key) for client in config.clients)
        self.report = report

    @property
    def checks(self) -> bool:
        """Whether keys are configured (and so checked)."""
        return bool(self.keys)

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request head presents a configured key.

        ``ClientConnection``'s ``admit``: the body of a refused request is
        read and dropped, never buffered.
        """
        # A reload may have removed every key since the connection opened.
        return not self.keys or check_client(headers, self.keys).allowed

    async def admit(self, client: ClientConnection, request: ClientRequest) -> Admitted | None:
        """The request to serve, or None after answering it ``401`` (keep-alive kept).

        Nothing of a refused request goes upstream, and nothing of what it
        presented is logged: the access line names no key, right or wrong.
        """
        if not self.keys:
            return Admitted(request, None)  # nothing checked, nothing removed
        check = None if request.refused else check_client(request.headers, self.keys)
        if check is None or not check.allowed:
            await self._refuse(client, request)
            return None
        # The client's Authorization and X-Api-Key were the proxy's key: a
        # node gets only its own configured headers.
        stripped = attrs.evolve(request, headers=forwarded_headers(request.headers, self.keys))
        return Admitted(stripped, check.name)

    async def _refuse(self, client: ClientConnection, request: ClientRequest) -> None:
        started = trio.current_time()
        path = request.target.split(b"?", 1)[0].decode("ascii", "replace")
        request_id = workload_id(request.headers)
        document = error_document(path, 401, "invalid_api_key", REFUSAL_MESSAGE)
        headers = [*error_headers("invalid_api_key"), (b"x-request-id", request_id.encode())]
        sent = 0
        with contextlib.suppress(ClientGone, h11.LocalProtocolError):
            sent = await client.send_json(401, document, headers)
        self.report.unauthorized(
            request_id, request.method.decode("ascii", "replace"), path, started, sent
        )
