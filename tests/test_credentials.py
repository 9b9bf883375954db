"""Per-node credentials: a configured key reaches its node, replaces the
client's, goes to no other node, and shows up nowhere else.

"Nowhere else" is checked on everything the proxy emits: log records (raw,
before any formatter could scrub them, and as the text and JSON formatters
print them), events, the admin routes, the 502 body and the client's
response, and ``trio-failover check``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable
from pathlib import Path

import attrs
import httpx
import pytest
import trio
import trio.testing
from leaks import PrintedLogs, closed_port
from typer.testing import CliRunner

from trio_failover.cli.cli import app
from trio_failover.cli.settings import resolve
from trio_failover.core.config import Config, Upstream
from trio_failover.core.errors import ConfigError
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, serve
from trio_failover.testing import (
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    drop_before_body,
    healthy,
    request,
    start_in_fleet,
)

# Not shaped like a bearer token on purpose where it stands alone (the
# X-Api-Key header): the log formatters scrub "Bearer <token>" patterns, and
# these tests must catch a leak that such a pattern would not hide.
SECRET = "sk-node-7f3a9c2e41d8b6"
CLIENT_KEY = "client-own-key-5e8d1a"
LIMIT = 20.0


def make_proxy(fleet: Fleet, nodes: dict[str, dict[str, str]], **settings: object) -> Proxy:
    upstreams = [attrs.evolve(node, headers=nodes.get(node.name, {})) for node in fleet.upstreams()]
    config = Config(upstreams=upstreams, admin_listen=None, **settings)  # type: ignore[arg-type]
    return Proxy(config, connector=fleet.connector)


def values(received: ReceivedRequest, name: bytes) -> list[bytes]:
    return [value for key, value in received.headers if key == name]


# --- what reaches which node --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "sent"),
    [
        ("Authorization", "Authorization"),
        ("authorization", "AUTHORIZATION"),
        ("AUTHORIZATION", "authorization"),
    ],
)
async def test_node_key_replaces_the_clients_key(
    autojump_clock: trio.abc.Clock, configured: str, sent: str
) -> None:
    async with Fleet({"hosted": FakeNode(healthy(b"ok"))}) as fleet:
        proxy = make_proxy(fleet, {"hosted": {configured: f"Bearer {SECRET}", "X-Api-Key": SECRET}})
        response = await request(
            proxy,
            body=b"{}",
            headers=[(sent, f"Bearer {CLIENT_KEY}"), ("X-Client-Tag", "kept")],
        )

    assert response is not None
    assert response.status == 200
    [received] = fleet["hosted"].received
    assert values(received, b"authorization") == [f"Bearer {SECRET}".encode()]
    assert values(received, b"x-api-key") == [SECRET.encode()]
    assert values(received, b"x-client-tag") == [b"kept"]
    assert CLIENT_KEY.encode() not in repr(received.headers).encode()
    # The node's key never travels back to the client.
    assert SECRET.encode() not in repr(response.headers).encode() + response.body


async def test_failover_carries_no_key_to_the_next_node(autojump_clock: trio.abc.Clock) -> None:
    nodes = {
        "keyed": FakeNode(drop_before_body()),
        "open": FakeNode(healthy(b"open")),
    }
    async with Fleet(nodes) as fleet:
        proxy = make_proxy(fleet, {"keyed": {"Authorization": f"Bearer {SECRET}"}})
        response = await request(
            proxy, body=b"{}", headers=[("Authorization", f"Bearer {CLIENT_KEY}")]
        )

    assert response is not None
    assert (response.status, response.body) == (200, b"open")
    [to_keyed] = fleet["keyed"].received
    [to_open] = fleet["open"].received
    assert values(to_keyed, b"authorization") == [f"Bearer {SECRET}".encode()]
    # A node without configured headers gets the client's own, untouched.
    assert values(to_open, b"authorization") == [f"Bearer {CLIENT_KEY}".encode()]
    assert SECRET.encode() not in repr(to_open.headers).encode()


# --- where the key must not appear -------------------------------------------------------------


def by_path(io: NodeIO, request: ReceivedRequest) -> Awaitable[None]:
    """``/v1/fail`` breaks before the body; anything else is served."""
    if request.target.endswith(b"/fail"):
        return drop_before_body()(io, request)
    return healthy(b'{"ok": true}')(io, request)


async def test_key_reaches_the_node_and_is_shown_nowhere(
    tmp_path: Path, printed_logs: PrintedLogs
) -> None:
    raw = printed_logs.raw
    environ = {"NODE_KEY": SECRET}
    client_auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
    config_path = tmp_path / "fleet.toml"
    responses: list[httpx.Response] = []
    admin: dict[str, httpx.Response] = {}
    with trio.fail_after(LIMIT):
        async with Fleet({"keyed": FakeNode(by_path)}) as fleet:
            keyed = await fleet.serve_tcp("keyed")
            config_path.write_text(
                f"""
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

[[upstream]]
name = "down"
url = "http://127.0.0.1:{closed_port()}"
headers = {{ Authorization = "Bearer ${{NODE_KEY}}" }}

[[upstream]]
name = "keyed"
url = "{keyed.url}"
headers = {{ Authorization = "Bearer ${{NODE_KEY}}", X-Api-Key = "${{NODE_KEY}}" }}
"""
            )
            config, _ = resolve({"config": str(config_path)}, environ)
            proxy = Proxy(config)
            with proxy.events.subscribe(0) as events:
                async with trio.open_nursery() as nursery:
                    addresses: BoundAddresses = await nursery.start(
                        functools.partial(serve, config, proxy=proxy)
                    )
                    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                        base = addresses.client_url
                        for path in ("/v1/chat/completions", "/v1/fail"):
                            responses.append(
                                await client.post(base + path, json={}, headers=client_auth)
                            )
                        assert addresses.admin_url is not None
                        for path in ("/status", "/metrics", "/"):
                            admin[path] = await client.get(addresses.admin_url + path)
                    nursery.cancel_scope.cancel()
                published = []
                while True:
                    try:
                        published.append(events.receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break

    with pytest.MonkeyPatch.context() as patch:
        for name in ("TRIO_FAILOVER_CONFIG", "TRIO_FAILOVER_UPSTREAMS"):
            patch.delenv(name, raising=False)
        check = CliRunner().invoke(app, ["check", "--config", str(config_path)], env=environ)

    # The key reached the node that has it, in place of the client's.
    served, failed = responses
    assert served.status_code == 200
    assert served.headers["x-failover-node"] == "keyed"
    assert failed.status_code == 502
    for received in fleet["keyed"].received:
        assert values(received, b"authorization") == [f"Bearer {SECRET}".encode()]
        assert values(received, b"x-api-key") == [SECRET.encode()]
    # Two requests; a health check, if one came meanwhile, carried the key too.
    assert len([r for r in fleet["keyed"].received if r.target != b"/v1/models"]) == 2

    # ...and nowhere else.
    assert check.exit_code == 0, check.output
    assert "Authorization:***" in check.output
    assert "X-Api-Key:***" in check.output
    places = {
        "log records": "\n".join(raw.lines),
        "text logs": printed_logs.text.getvalue(),
        "json logs": printed_logs.json.getvalue(),
        "events": json.dumps(published),
        "client responses": repr([(r.headers.raw, r.content) for r in responses]),
        "check": check.output,
        **{f"admin {path}": response.text for path, response in admin.items()},
    }
    assert raw.lines
    assert published
    assert admin["/status"].status_code == 200
    assert [place for place, text in places.items() if SECRET in text] == []
    assert [place for place, text in places.items() if CLIENT_KEY in text] == []


# --- places a secret could leak through ---------------------------------------------------------


async def test_unsendable_header_value_leaks_neither_in_errors_nor_in_logs(
    autojump_clock: trio.abc.Clock, printed_logs: PrintedLogs
) -> None:
    raw = printed_logs.raw
    headers = {"X-Api-Key": SECRET + " "}
    async with Fleet({"keyed": FakeNode(healthy(b"keyed")), "open": FakeNode()}) as fleet:
        refused: ConfigError | None = None
        try:
            proxy = make_proxy(fleet, {"keyed": headers})
        except ConfigError as exc:  # refusing the value up front is a fix too
            refused = exc
        if refused is not None:
            assert SECRET not in str(refused)
            return
        response = await request(proxy, body=b"{}")

    assert response is not None
    assert SECRET.encode() not in response.body
    assert [line for line in raw.lines if SECRET in line] == []


def test_config_repr_hides_header_values() -> None:
    node = Upstream("keyed", "http://127.0.0.1:9", headers={"Authorization": SECRET})
    config = Config(upstreams=[node])
    assert SECRET not in repr(node)
    assert SECRET not in repr(config)


async def test_malformed_request_does_not_log_the_clients_key(
    autojump_clock: trio.abc.Clock, printed_logs: PrintedLogs
) -> None:
    raw = printed_logs.raw
    async with Fleet({"a": FakeNode()}) as fleet:
        proxy = await start_in_fleet(make_proxy(fleet, {}))
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.handle_connection, server)
            # A space before the colon makes the whole line invalid (RFC 9112 5.1).
            await client.send_all(
                b"GET /health HTTP/1.1\r\nHost: proxy.test\r\n"
                b"Authorization : Bearer " + CLIENT_KEY.encode() + b"\r\n\r\n"
            )
            answer = b""
            while chunk := await client.receive_some(65536):
                answer += chunk

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert [line for line in raw.lines if CLIENT_KEY in line] == []


@pytest.mark.parametrize("value", ["a\r\nInjected: 1", "a\x00b", "a\x7fb"])
def test_header_values_with_control_characters_are_refused_without_echoing(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Upstream("keyed", "http://127.0.0.1:9", headers={"X-Api-Key": SECRET + value})
    assert SECRET not in str(caught.value)
    assert "X-Api-Key" in str(caught.value)
