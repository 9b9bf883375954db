"""The admin listener: ``/healthz``, ``/status``, ``/usage``, ``/history``, ``/metrics``,
``/events``, ``/``.

It listens on its own address (``--admin-listen``), apart from the client
listener, so exposing the proxy never exposes the admin API. Requests are
read as the client listener reads its own (``wire/client.py``: keep-alive,
the same screen, limits and deadlines), answered for GET and HEAD only. ``GET /events`` with
``Upgrade: websocket`` hands the connection to trio-websocket, which
streams one JSON text message per event (docs/observability.md).

The event stream never slows the proxy: the proxy publishes into a bounded
per-subscriber buffer (``events.EventBus``), and a subscriber that falls
behind is dropped. Its WebSocket then gets ``CLOSE_GRACE`` seconds to take
the close frame (code 1008, the reason as text) before the TCP connection
is cut.

The ticker that notices cooldown expiries on an idle proxy is not here:
``server.serve`` runs it, with or without an admin listener. The sampler
of the dashboard's history (``sampler.py``) is: it lives as long as the
listener that shows it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import json
import re
import secrets
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import attrs
import h11
import trio
import trio_websocket

from ..core.answers import error_document, error_headers
from ..core.auth import admin_allowed
from ..core.config import Config, split_host_port
from ..core.headers import get
from ..core.reload import config_document, hmac_mask, masked
from ..proxy.proxy import Proxy
from ..telemetry.events import SUBSCRIBER_BUFFER, Subscription
from ..telemetry.logs import logger
from ..wire.client import ClientConnection, ClientGone, ClientRequest
from ..wire.http1 import phrase
from . import roster
from .history import History
from .sampler import sample_history

# A request head must arrive (and a keep-alive connection must show a next
# request) within this long; the admin API has no slow clients worth waiting for.
ADMIN_HEAD_TIMEOUT = 30.0
ADMIN_MAX_HEAD = 16 * 1024
# How long a dropped or closing subscriber gets for the WebSocket close
# handshake before the connection is simply closed.
CLOSE_GRACE = 5.0
# RFC 6455 7.4.1: 1008 "policy violation", the policy being "keep up".
CLOSE_FELL_BEHIND = 1008
# Clients have nothing to say on /events; anything bigger is a misuse.
WS_MAX_MESSAGE = 4096

Headers = list[tuple[bytes, bytes]]


@attrs.frozen
class Reply:
    """One plain HTTP answer of the admin API."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()


async def serve_admin(
    proxy: Proxy,
    listen: str,
    *,
    event_buffer: int = SUBSCRIBER_BUFFER,
    history: History | None = None,
    sock: socket.socket | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API on ``listen`` (or on ``sock``, already listening) until cancelled.

    Args:
        proxy: the proxy to report on.
        listen: ``HOST:PORT`` (port 0: any free port).
        event_buffer: events held for each ``/events`` subscriber before it
            counts as fallen behind and is dropped.
        history: the rings ``GET /history`` shows (default: 15 minutes at
            10 s a point), filled by a sampler this listener runs.
        sock: a socket already bound and listening, to serve instead of
            opening one on ``listen`` (a ``--workers`` supervisor binds once).
        task_status: receives the bound ``(host, port)``.
    """
    host, port = split_host_port(listen, "admin-listen")
    if sock is not None:  # a --workers supervisor's (service/workers.py)
        listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock))]
    else:
        listeners = await trio.open_tcp_listeners(port, host=host)
    sockname = listeners[0].socket.getsockname()
    if history is None:
        history = History(node.name for node in proxy.config.upstreams)
    handler = functools.partial(
        serve_admin_connection, proxy, event_buffer=event_buffer, history=history
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_history, proxy, history)
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        task_status.started((sockname[0], sockname[1]))


async def serve_admin_connection(
    proxy: Proxy,
    stream: trio.abc.Stream,
    *,
    event_buffer: int = SUBSCRIBER_BUFFER,
    history: History | None = None,
) -> None:
    """Serve one admin connection on any stream until it closes; closes ``stream``.

    The connection is read as the client listener reads its own
    (``wire.client.ClientConnection``: one reader task, the head screen,
    the size limits and deadlines), so a bad request gets the same answer
    on both listeners: ``400``, ``408``, ``413`` or ``431`` with a JSON error.
    Tests drive this on in-memory streams; ``serve_admin`` on accepted sockets.
    Without a ``history`` (nobody samples one), ``/history`` is a ``404``.
    """
    connection = ClientConnection(
        stream,
        max_head=ADMIN_MAX_HEAD,
        # No admin route takes a body: a small one is read and dropped.
        max_body=ADMIN_MAX_HEAD,
        client_header_timeout=ADMIN_HEAD_TIMEOUT,
        keepalive_timeout=ADMIN_HEAD_TIMEOUT,
        admin=True,
    )

    async def answer(client: ClientConnection, request: ClientRequest) -> bool:
        return await _answer(proxy, client, request, event_buffer, history)

    try:
        await connection.serve(answer)
    except Exception as exc:
        # The boundary of one admin connection: trio.serve_listeners would
        # take the whole admin listener down with an escaping error.
        if _is_disconnect(exc):
            logger.debug("admin connection ended", extra={"fields": {"error": repr(exc)}})
        else:
            logger.exception("admin connection failed")
    finally:
        await trio.aclose_forcefully(stream)


async def _answer(
    proxy: Proxy,
    client: ClientConnection,
    request: ClientRequest,
    event_buffer: int,
    history: History | None,
) -> bool:
    """Answer one admin request; returns whether the connection may carry another."""
    path = request.target.split(b"?", 1)[0]
    if not _authorized(proxy, request, path):
        proxy.metrics.child(proxy.metrics.unauthorized, "admin").inc()
        reply = _UNAUTHORIZED
    elif path == b"/events" and _wants_websocket(request):
        refusal = _check_websocket(request)
        if refusal is None:
            await _serve_events(proxy, client, request, event_buffer)
            return False
        reply = refusal
    else:
        reply = await _route(proxy, request, path, history)
    await _send_reply(client, reply)
    return True


def _is_disconnect(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_disconnect(inner) for inner in exc.exceptions)
    return isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | ClientGone)


async def _send_reply(client: ClientConnection, reply: Reply) -> None:
    headers: Headers = [
        (b"content-type", reply.content_type),
        (b"content-length", b"%d" % len(reply.body)),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        *reply.headers,
    ]
    # The body is left out in answer to a HEAD (the writer knows the request).
    response = h11.Response(status_code=reply.status, reason=phrase(reply.status), headers=headers)
    await client.send(response, h11.Data(data=reply.body), h11.EndOfMessage())


def _error(status: int, code: str, message: str) -> Reply:
    body = json.dumps(error_document("", status, code, message, admin=True))
    return Reply(status, body.encode())


def _authorized(proxy: Proxy, request: ClientRequest, path: bytes) -> bool:
    # /healthz stays open: a load balancer probes it without credentials.
    # Every other path needs the token, unknown ones too, so that a client
    # without it learns nothing, not even which routes exist.
    token = proxy.config.admin_token
    if token is None or path == b"/healthz":
        return True
    return admin_allowed(request.headers, request.target, token)


# The answer names no token and echoes nothing the client sent.
_UNAUTHORIZED = attrs.evolve(
    _error(401, "invalid_admin_token", "missing or invalid admin token"),
    headers=tuple(error_headers("invalid_admin_token")),
)


async def _route(
    proxy: Proxy, request: ClientRequest, path: bytes, history: History | None
) -> Reply:
    # None: the route that may wait (with a shared state, /usage's counts are in Redis).
    routes: dict[bytes, Callable[[Proxy, ClientRequest], Reply] | None] = {
        b"/healthz": lambda p, _: _healthz_reply(p),
        b"/status": lambda p, _: _status_reply(p),
        b"/usage": None,
        b"/metrics": _metrics_reply,
        b"/config": lambda p, _: Reply(200, json.dumps(running_config(p.config)).encode()),
        b"/": lambda _, __: _dashboard_reply(),
        b"/events": lambda _, __: Reply(
            426,
            _error(426, "upgrade_required", "/events is a WebSocket").body,
            headers=((b"upgrade", b"websocket"), (b"sec-websocket-version", b"13")),
        ),
    }
    if history is not None:
        routes[b"/history"] = lambda _, __: Reply(200, json.dumps(history.document()).encode())
    if path not in routes:
        return _error(404, "not_found", "not found")
    if request.method not in (b"GET", b"HEAD"):
        reply = _error(405, "method_not_allowed", "the admin API is read-only")
        return attrs.evolve(reply, headers=((b"allow", b"GET, HEAD"),))
    answer = routes[path]
    if answer is None:
        return Reply(200, json.dumps(await proxy.usage()).encode())
    return answer(proxy, request)


def _status_reply(proxy: Proxy) -> Reply:
    document = proxy.status()
    workers = roster.listed()  # a --workers fleet's first worker lists them all
    if workers is not None:
        document["workers"] = workers
    return Reply(200, json.dumps(document).encode())


def running_config(config: Config) -> dict[str, object]:
    """``GET /config``: the running settings, every secret an HMAC under a fresh salt.

    ``check --config FILE --admin URL`` masks its own settings with the same
    salt and compares (``core/reload.py``): a rotated key shows as rotated,
    and no secret, nor a digest that could be matched across requests, leaves.
    """
    salt = secrets.token_bytes(16)
    return {"salt": salt.hex(), "config": config_document(masked(config, hmac_mask(salt)))}


def _healthz_reply(proxy: Proxy) -> Reply:
    # A drain lasts --shutdown-timeout: a load balancer polling /healthz sees
    # the 503 at its next check and stops sending while in-flight work ends.
    if proxy.draining:
        return Reply(503, b"draining", b"text/plain; charset=utf-8")
    return Reply(200, b"ok", b"text/plain; charset=utf-8")


def _metrics_reply(proxy: Proxy, request: ClientRequest) -> Reply:
    # Prometheus asks for OpenMetrics in Accept; curl and older scrapers
    # get the classic text format.
    accept = b", ".join(value for name, value in request.headers if name == b"accept")
    body, content_type = proxy.metrics.render(accept.decode("latin-1"))
    return Reply(200, body, content_type.encode())


# -- the dashboard ---------------------------------------------------------------


@functools.cache
def _dashboard_reply() -> Reply:
    page = importlib.resources.files(__package__).joinpath("dashboard.html").read_bytes()
    # The page's one script and one style are allowed by hash and nothing else
    # is: no inline handler, no other origin, no framing (clickjacking).
    scripts = " ".join(_csp_hashes(page, b"script"))
    styles = " ".join(_csp_hashes(page, b"style"))
    policy = (
        f"default-src 'none'; script-src {scripts}; style-src {styles}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    )
    headers = (
        (b"content-security-policy", policy.encode()),
        (b"x-frame-options", b"DENY"),
        # Opened as /?token=..., the page's URL holds the admin token: no
        # request it makes may carry that URL on as a Referer.
        (b"referrer-policy", b"no-referrer"),
    )
    return Reply(200, page, b"text/html; charset=utf-8", headers)


def _csp_hashes(page: bytes, tag: bytes) -> list[str]:
    pattern = re.compile(rb"<" + tag + rb">(.*?)</" + tag + rb">", re.DOTALL)
    return [
        "'sha256-" + base64.b64encode(hashlib.sha256(body).digest()).decode() + "'"
        for body in pattern.findall(page)
    ]


# -- /events ---------------------------------------------------------------------


def _header(request: ClientRequest, name: bytes) -> bytes | None:
    return get(request.headers, name)


def _wants_websocket(request: ClientRequest) -> bool:
    upgrade = _header(request, b"upgrade") or b""
    return b"websocket" in upgrade.lower()


def _check_websocket(request: ClientRequest) -> Reply | None:
    """Why the upgrade is refused, or None to accept it."""
    if request.method != b"GET":
        return _error(405, "method_not_allowed", "a WebSocket opens with GET")
    if _header(request, b"sec-websocket-version") != b"13":
        reply = _error(426, "upgrade_required", "WebSocket version 13 is required")
        return attrs.evolve(reply, headers=((b"sec-websocket-version", b"13"),))
    if not _header(request, b"sec-websocket-key"):
        return _error(400, "bad_request", "missing Sec-WebSocket-Key")
    # Browsers let any web page open a WebSocket to any address, loopback
    # included, and send their Origin. Only the dashboard's own origin (or a
    # non-browser client, which sends none) may read the events.
    origin = _header(request, b"origin")
    host = _header(request, b"host") or b""
    if origin is not None and urlsplit(origin.decode("latin-1")).netloc.lower() != (
        host.decode("latin-1").lower()
    ):
        return _error(403, "forbidden_origin", "cross-origin WebSocket refused")
    return None


def _request_head(request: ClientRequest) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (request.method, request.target)]
    lines += [name + b": " + value for name, value in request.headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _serve_events(
    proxy: Proxy, client: ClientConnection, request: ClientRequest, event_buffer: int
) -> None:
    # Subscribe before the handshake so nothing published from the moment
    # the client is told "101" is missed.
    with proxy.events.subscribe(event_buffer) as subscription:
        # h11 consumed the upgrade request; trio-websocket (wsproto) wants
        # to read the handshake itself, so it is given the head again.
        replay = client.take_over(_request_head(request))
        async with trio.open_nursery() as nursery:
            ws = None
            # Only the handshake has a deadline; a subscriber may listen for days.
            with trio.move_on_after(ADMIN_HEAD_TIMEOUT):
                ws_request = await trio_websocket.wrap_server_stream(
                    nursery, replay, max_message_size=WS_MAX_MESSAGE
                )
                ws = await ws_request.accept()
            if ws is not None:
                await _pump_events(ws, subscription)
            nursery.cancel_scope.cancel()


async def _pump_events(ws: trio_websocket.WebSocketConnection, sub: Subscription) -> None:
    """Send each event as a JSON text message until the client leaves or falls behind."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_wait_client_gone, ws, nursery.cancel_scope)
        nursery.start_soon(_cut_when_dropped, sub, nursery.cancel_scope)
        try:
            async for event in sub:
                if sub.fell_behind:
                    break  # what is still buffered is stale: stop at once
                await ws.send_message(json.dumps(event))
        except trio_websocket.ConnectionClosed:
            nursery.cancel_scope.cancel()
            return
        # Only a drop ends the iteration while the client is still there.
        logger.warning("events subscriber dropped", extra={"fields": {"reason": sub.dropped}})
        await ws.aclose(CLOSE_FELL_BEHIND, (sub.dropped or "")[:120])
        nursery.cancel_scope.cancel()


async def _wait_client_gone(
    ws: trio_websocket.WebSocketConnection, scope: trio.CancelScope
) -> None:
    # Reading also keeps trio-websocket answering pings and the close handshake.
    try:
        while True:
            await ws.get_message()
    except trio_websocket.ConnectionClosed:
        scope.cancel()


async def _cut_when_dropped(sub: Subscription, scope: trio.CancelScope) -> None:
    # A dropped subscriber may be blocked in send_message because its client
    # stopped reading; it gets CLOSE_GRACE seconds to take the close frame.
    await sub.wait_ended()
    await trio.sleep(CLOSE_GRACE)
    scope.cancel()
