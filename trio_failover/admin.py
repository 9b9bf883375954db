"""The admin listener: health, status, metrics (events and dashboard: see issue 7)."""

from __future__ import annotations

import functools
import json

import h11
import trio

from .config import split_host_port
from .proxy import Proxy


async def serve_admin(
    proxy: Proxy,
    listen: str,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API on ``listen`` (HOST:PORT); reports the bound address."""
    host, port = split_host_port(listen, "admin-listen")
    listeners = await trio.open_tcp_listeners(port, host=host)
    sockname = listeners[0].socket.getsockname()
    async with trio.open_nursery() as nursery:
        task_status.started((sockname[0], sockname[1]))
        await trio.serve_listeners(functools.partial(_handle, proxy), listeners)
        nursery.cancel_scope.cancel()


async def _handle(proxy: Proxy, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                with trio.move_on_after(30):
                    conn.receive_data(bytes(await stream.receive_some(65536)))
                    continue
                return
            if not isinstance(event, h11.Request):
                return
            status, content_type, body = _route(proxy, event.target.split(b"?")[0])
            headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
            data = conn.send(h11.Response(status_code=status, headers=headers))
            data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            await stream.send_all(data)
            return
    except (h11.RemoteProtocolError, trio.BrokenResourceError):
        return
    finally:
        await trio.aclose_forcefully(stream)


def _route(proxy: Proxy, path: bytes) -> tuple[int, bytes, bytes]:
    if path == b"/healthz":
        return 200, b"text/plain", b"ok"
    if path == b"/status":
        return 200, b"application/json", json.dumps(proxy.status()).encode()
    if path == b"/metrics":
        return 200, b"text/plain; version=0.0.4", proxy.metrics.exposition()
    return 404, b"application/json", b'{"error": {"message": "not found", "code": "not_found"}}'
