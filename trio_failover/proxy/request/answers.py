"""The answers the proxy makes itself, not a node's stream.

The last retryable answer relayed as the node sent it, the JSON error when
every node failed (or none serves the model), and the ``503`` of a workload
the queue refused. Their bodies and extra headers come from
``core/answers.py``; these functions only set the workload's status and
write.
"""

from __future__ import annotations

import contextlib

import h11

from ...core.answers import error_document, error_headers
from ...core.headers import client_response_headers
from ...core.outcome import SavedResponse
from ...core.workload import State
from ...wire.client import ClientConnection, ClientGone
from ..nodes.queue import REFUSALS
from ..records import Workload
from ..report import Report


async def send_saved(client: ClientConnection, work: Workload, saved: SavedResponse) -> bool:
    """Relay the last retryable answer as the node sent it."""
    headers = client_response_headers(
        saved.headers,
        saved.status,
        request_id=work.id,
        node=saved.node,
        attempts=len(work.attempts),
        keep_length=False,
    )
    headers.append((b"content-length", b"%d" % len(saved.body)))
    try:
        await client.send(
            h11.Response(status_code=saved.status, reason=saved.reason, headers=headers),
            h11.Data(data=saved.body),
            h11.EndOfMessage(),
        )
    except ClientGone:
        return False
    work.sent(0 if work.method == "HEAD" else len(saved.body))
    return True


async def send_failure(
    client: ClientConnection,
    work: Workload,
    status: int,
    code: str,
    message: str,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Answer ``status`` with the proxy's JSON error and the attempt records.

    ``extra``: headers beyond the code's own (a computed ``Retry-After``).
    """
    work.answered(status)
    attempts = [record.to_json() for record in work.attempts]
    # Ollama's shape under /api/, OpenAI's elsewhere.
    document = error_document(work.path, status, code, message, attempts)
    headers = [
        (b"x-request-id", work.id.encode()),
        (b"x-failover-attempts", b"%d" % len(work.attempts)),
        *error_headers(code),
        *extra,
    ]
    with contextlib.suppress(ClientGone, h11.LocalProtocolError):
        # The access line's bytes count the proxy's own bodies too.
        work.sent(await client.send_json(status, document, headers))


async def turn_away(client: ClientConnection, work: Workload, report: Report, reason: str) -> bool:
    """Answer ``503`` for a workload the queue refused; nothing was sent for it."""
    code, message = REFUSALS[reason]
    work.finish(State.FAILED)
    report.turned_away(reason)
    await send_failure(client, work, 503, code, message)
    return True
