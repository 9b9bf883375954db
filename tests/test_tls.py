"""TLS on both sides of the proxy, over real sockets on 127.0.0.1.

Upstream: https:// nodes are fake nodes behind ``trio.SSLStream`` with
certificates from a throwaway ``trustme`` CA; the proxy's ``TCPConnector``
must verify them (CA and host name), name a failure ``tls_error`` and move on
before commit, and bound the handshake by the connect timeout.

Downstream: the proxy terminates TLS (``tls_cert``/``tls_key``) for real
clients (httpx, curl and a raw ``SSLStream`` with h11), keeps connections
alive, and survives clients that speak plain HTTP to the TLS port or never
finish a handshake.

No test here uses MockClock: real I/O is in flight. Each one is bounded by
``trio.fail_after``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import h11
import httpx
import pytest
import trio
import trustme
from conftest import LogRecords
from cryptography.hazmat.primitives import serialization

from trio_failover.core.config import Config, Upstream
from trio_failover.core.errors import ConfigError
from trio_failover.proxy import Proxy
from trio_failover.service.server import BoundAddresses, log_tls_warnings, serve, server_ssl_context
from trio_failover.testing import (
    Behaviour,
    FakeNode,
    Fleet,
    NodeIO,
    ReceivedRequest,
    healthy,
    read_response,
    request,
    slow_head,
)
from trio_failover.wire.upstream import TCPConnector

LIMIT = 20.0  # real seconds for any one test


# --- certificates ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def other_ca() -> trustme.CA:
    """A CA the proxy is never told about."""
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(path)
    return str(path)


@pytest.fixture
def listener_files(ca: trustme.CA, tmp_path: Path) -> tuple[str, str]:
    """``(tls_cert, tls_key)`` for the proxy's own listener on 127.0.0.1."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key = tmp_path / "proxy-chain.pem", tmp_path / "proxy-key.pem"
    for blob in cert.cert_chain_pems:
        blob.write_to_path(chain, append=True)
    cert.private_key_pem.write_to_path(key)
    return str(chain), str(key)


def client_context(ca_file: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2", "http/1.1"])  # as curl and browsers offer
    return context


# --- fake HTTPS nodes ------------------------------------------------------------------------


class TLSNode:
    """A ``FakeNode`` behind TLS on a real socket.

    Records what each handshake showed: the SNI name the client sent, the
    ALPN protocol agreed, and how many handshakes failed (a client that
    rejected the certificate).
    """

    def __init__(self, cert: trustme.LeafCert, node: FakeNode | None = None) -> None:
        self.node = node or FakeNode(healthy(b"from tls"))
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(self.context)
        self.context.set_alpn_protocols(["http/1.1"])
        self.context.sni_callback = self._sni
        self.server_names: list[str | None] = []
        self.alpn: list[str | None] = []
        self.failed_handshakes = 0

    def _sni(self, sslobj: ssl.SSLObject, name: str | None, context: ssl.SSLContext) -> None:
        self.server_names.append(name)

    async def handle(self, stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, self.context, server_side=True, https_compatible=True)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError:
            self.failed_handshakes += 1
            await trio.aclose_forcefully(stream)
            return
        self.alpn.append(tls.selected_alpn_protocol())
        await self.node.serve_connection(tls)


async def listen(nursery: trio.Nursery, handler: object) -> int:
    """Serve ``handler`` on 127.0.0.1 with a free port; returns the port."""
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def silent_handler(stream: trio.SocketStream) -> None:
    """Accepts TCP and reads, but never answers: a TLS handshake that never ends."""
    try:
        while await stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        pass
    finally:
        await trio.aclose_forcefully(stream)


async def wait_until(condition: Callable[[], bool], *, polls: int = 200) -> None:
    """Poll ``condition`` every 50 ms, at most ``polls`` times."""
    for _ in range(polls):
        if condition():
            return
        await trio.sleep(0.05)
    raise AssertionError("condition not met in time")


def config_for(*upstreams: Upstream, **settings: object) -> Config:
    settings.setdefault("discovery_interval", 0)  # the nodes count their requests
    return Config(upstreams=upstreams, listen="127.0.0.1:0", admin_listen=None, **settings)  # type: ignore[arg-type]


def attempts_of(proxy: Proxy) -> list[dict[str, object]]:
    """The attempt records of the proxy's last workload."""
    attempts = proxy.recent[-1]["attempts"]
    assert isinstance(attempts, list)
    return attempts


# --- upstream TLS ------------------------------------------------------------------------------


async def test_https_node_with_a_trusted_ca_serves(ca: trustme.CA, ca_file: str) -> None:
    tls = TLSNode(ca.issue_cert("localhost", "127.0.0.1"))
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, tls.handle)
            node = Upstream("secure", f"https://localhost:{port}", ca_file=ca_file)
            proxy = await nursery.start(Proxy(config_for(node)).run)
            response = await request(proxy, "POST", "/v1/chat/completions", body=b"{}")
            nursery.cancel_scope.cancel()

    assert response is not None
    assert (response.status, response.body, response.complete) == (200, b"from tls", True)
    assert response.header("x-failover-node") == "secure"
    assert tls.failed_handshakes == 0
    assert tls.server_names == ["localhost"]  # SNI is the node's host
    assert tls.alpn == ["http/1.1"]
    [received] = tls.node.received
    assert received.header("host") == f"localhost:{port}".encode()
    assert received.body == b"{}"


@pytest.mark.parametrize(
    ("names", "served"),
    [
        pytest.param(("127.0.0.1",), True, id="ip-in-certificate"),
        pytest.param(("localhost",), False, id="ip-not-in-certificate"),
    ],
)
async def test_ip_literal_node_is_checked_against_the_certificate(
    ca: trustme.CA, ca_file: str, names: tuple[str, ...], served: bool
) -> None:
    tls = TLSNode(ca.issue_cert(*names))
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, tls.handle)
            node = Upstream("ip", f"https://127.0.0.1:{port}", ca_file=ca_file)
            proxy = await nursery.start(Proxy(config_for(node)).run)
            response = await request(proxy, "GET", "/health")
            nursery.cancel_scope.cancel()

    assert response is not None
    if served:
        assert response.status == 200
        # No SNI for an address (RFC 6066 section 3): the callback sees None.
        assert tls.server_names in ([], [None])
    else:
        assert response.status == 502
        [attempt] = attempts_of(proxy)
        assert attempt["outcome"] == "tls_error"
        assert "CERTIFICATE_VERIFY_FAILED" in str(attempt["detail"])
        assert "127.0.0.1" in str(attempt["detail"])  # the name that did not match
        assert tls.node.received == []


@pytest.mark.parametrize("pinned", [False, True], ids=["system-store", "pinned-other-ca"])
async def test_untrusted_certificate_fails_over_before_commit(
    ca_file: str, other_ca: trustme.CA, pinned: bool
) -> None:
    # The node's certificate comes from a CA that neither the system store
    # nor the node's ca_file knows.
    impostor = TLSNode(other_ca.issue_cert("localhost", "127.0.0.1"))
    with trio.fail_after(LIMIT):
        async with (
            Fleet({"plain": FakeNode(healthy(b"from plain"))}) as fleet,
            trio.open_nursery() as nursery,
        ):
            port = await listen(nursery, impostor.handle)
            bad = Upstream(
                "impostor", f"https://localhost:{port}", ca_file=ca_file if pinned else None
            )
            plain = await fleet.serve_tcp("plain")
            proxy = await nursery.start(Proxy(config_for(bad, plain)).run)
            first = await request(proxy, "POST", "/v1/chat/completions", body=b"{}")
            first_attempts = attempts_of(proxy)
            # The proxy keeps serving, and the node is not demoted for it.
            second = await request(proxy, "POST", "/v1/chat/completions", body=b"{}")
            nodes = {node["name"]: node for node in proxy.status()["nodes"]}
            nursery.cancel_scope.cancel()

    for response in (first, second):
        assert response is not None
        assert (response.status, response.body) == (200, b"from plain")
        assert response.header("x-failover-node") == "plain"
        assert response.header("x-failover-attempts") == "2"
    failed, served = first_attempts
    assert failed["node"] == "impostor"
    assert failed["outcome"] == "tls_error"
    assert "CERTIFICATE_VERIFY_FAILED" in str(failed["detail"])
    assert served["outcome"] == "completed"
    # Nothing, not even the request head, went to the unverified peer.
    assert impostor.failed_handshakes == 2
    assert impostor.node.received == []
    assert nodes["impostor"]["state"] == "ready"


async def test_lone_untrusted_node_gives_502_naming_the_tls_error(other_ca: trustme.CA) -> None:
    impostor = TLSNode(other_ca.issue_cert("localhost"))
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, impostor.handle)
            proxy = await nursery.start(
                Proxy(config_for(Upstream("impostor", f"https://localhost:{port}"))).run
            )
            response = await request(proxy, "POST", "/v1/chat/completions", body=b"{}")
            nursery.cancel_scope.cancel()

    assert response is not None
    assert response.status == 502
    [attempt] = response.json()["attempts"]
    assert attempt["node"] == "impostor"
    assert attempt["outcome"] == "tls_error"


async def test_insecure_skip_verify_connects_and_is_warned_about(
    other_ca: trustme.CA, logged: LogRecords
) -> None:
    # Untrusted CA and a name that is not the node's: both checks are off.
    tls = TLSNode(other_ca.issue_cert("somewhere-else.example"))
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, tls.handle)
            node = Upstream("lab", f"https://localhost:{port}", insecure_skip_verify=True)
            config = config_for(node)
            proxy = Proxy(config)
            addresses: BoundAddresses = await nursery.start(
                functools.partial(serve, config, proxy=proxy)
            )
            warnings = [r for r in logged.at(logging.WARNING) if r.fields.get("node") == "lab"]  # type: ignore[attr-defined]
            async with httpx.AsyncClient(trust_env=False) as client:
                response = await client.get(f"{addresses.client_url}/health")
            nursery.cancel_scope.cancel()

    assert response.status_code == 200
    assert response.text == "from tls"
    assert tls.server_names == ["localhost"]
    # serve() warned once, before it listened.
    [warning] = warnings
    assert "insecure_skip_verify" in warning.getMessage()


def test_tls_warnings_name_weakened_and_ignored_settings(logged: LogRecords) -> None:
    config = config_for(
        Upstream("checked", "https://a.example"),
        Upstream("unchecked", "https://b.example", insecure_skip_verify=True),
        Upstream("plain-with-ca", "http://c.example", ca_file="/etc/ssl/fleet-ca.pem"),
    )
    log_tls_warnings(config)
    warned = {record.fields["node"]: record.getMessage() for record in logged.at(logging.WARNING)}  # type: ignore[attr-defined]
    assert set(warned) == {"unchecked", "plain-with-ca"}
    assert "verification is off" in warned["unchecked"]
    assert "ignored for an http:// node" in warned["plain-with-ca"]


async def test_slow_tls_handshake_is_bounded_by_the_connect_timeout() -> None:
    # The head deadline is far away: only the connect timeout can end the
    # handshake in time. Streamed, so that the 60 s header timeout is the
    # deadline in force (an unstreamed body would have 10 min).
    connect_timeout = 0.5
    with trio.fail_after(LIMIT):
        async with (
            Fleet({"plain": FakeNode(healthy(b"from plain"))}) as fleet,
            trio.open_nursery() as nursery,
        ):
            port = await listen(nursery, silent_handler)
            stuck = Upstream("stuck", f"https://localhost:{port}")
            plain = await fleet.serve_tcp("plain")
            config = config_for(
                stuck, plain, connect_timeout=connect_timeout, response_header_timeout=60.0
            )
            proxy = await nursery.start(Proxy(config).run)
            started = trio.current_time()
            response = await request(
                proxy, "POST", "/v1/chat/completions", body=b'{"stream": true}'
            )
            elapsed = trio.current_time() - started
            nodes = {node["name"]: node for node in proxy.status()["nodes"]}
            nursery.cancel_scope.cancel()

    assert response is not None
    assert (response.status, response.body) == (200, b"from plain")
    failed, _ = attempts_of(proxy)
    assert failed["outcome"] == "connect_timeout"
    assert connect_timeout * 1000 <= float(failed["elapsed_ms"]) < 5000  # type: ignore[arg-type]
    assert elapsed < 5.0  # far below the 60 s head deadline
    assert nodes["stuck"]["state"] == "ready"  # a connect timeout does not demote


async def test_handshake_within_the_connect_timeout_is_not_a_timeout(
    ca: trustme.CA, ca_file: str
) -> None:
    # A handshake that starts late (a busy TLS terminator) but ends inside
    # the connect timeout is a normal attempt.
    tls = TLSNode(ca.issue_cert("localhost"))

    async def late(stream: trio.SocketStream) -> None:
        await trio.sleep(0.3)
        await tls.handle(stream)

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, late)
            node = Upstream("late", f"https://localhost:{port}", ca_file=ca_file)
            proxy = await nursery.start(Proxy(config_for(node, connect_timeout=3.0)).run)
            response = await request(proxy, "GET", "/health")
            nursery.cancel_scope.cancel()

    assert response is not None
    assert response.status == 200
    [attempt] = attempts_of(proxy)
    assert attempt["outcome"] == "completed"


def eof_delimited(body: bytes) -> Behaviour:
    """An HTTP/1.0-style response (no length, ends at close) and a bare TCP FIN.

    Many HTTPS servers close without a TLS close_notify; the body must still
    count as complete.
    """

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        await io.send_raw(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + body)
        assert isinstance(io.stream, trio.SSLStream)
        await io.stream.transport_stream.aclose()

    return behave


async def test_node_closing_without_close_notify_ends_the_body(
    ca: trustme.CA, ca_file: str
) -> None:
    tls = TLSNode(ca.issue_cert("localhost"), FakeNode(eof_delimited(b"whole body")))
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            port = await listen(nursery, tls.handle)
            node = Upstream("terse", f"https://localhost:{port}", ca_file=ca_file)
            proxy = await nursery.start(Proxy(config_for(node)).run)
            response = await request(proxy, "GET", "/health")
            nursery.cancel_scope.cancel()

    assert response is not None
    assert (response.status, response.body, response.complete) == (200, b"whole body", True)
    [attempt] = attempts_of(proxy)
    assert attempt["outcome"] == "completed"


def test_connector_verifies_by_default_and_shares_contexts(ca_file: str, tmp_path: Path) -> None:
    config = config_for(
        Upstream("system-a", "https://a.example"),
        Upstream("system-b", "https://b.example"),
        Upstream("pinned", "https://c.example", ca_file=ca_file),
        Upstream("lab", "https://d.example", insecure_skip_verify=True),
        Upstream("plain", "http://e.example"),
    )
    connector = TCPConnector(config)
    by_name = {node.name: connector.ssl_context(node) for node in config.upstreams[:4]}
    for name in ("system-a", "pinned"):
        assert by_name[name].verify_mode is ssl.CERT_REQUIRED
        assert by_name[name].check_hostname
    assert by_name["system-a"] is by_name["system-b"]
    assert by_name["pinned"] is not by_name["system-a"]
    assert by_name["lab"].verify_mode is ssl.CERT_NONE
    assert not by_name["lab"].check_hostname
    # Only the pinned CA is trusted for the pinned node, not the system store too.
    assert len(by_name["pinned"].get_ca_certs()) == 1


@pytest.mark.parametrize("content", [None, b"not a certificate\n"], ids=["missing", "garbage"])
def test_unloadable_ca_file_is_a_config_error(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_bytes(content)
    config = config_for(Upstream("pinned", "https://c.example", ca_file=str(path)))
    with pytest.raises(ConfigError) as caught:
        TCPConnector(config)
    assert caught.value.option == "upstream.ca_file"
    assert "pinned" in str(caught.value)


# --- downstream TLS ----------------------------------------------------------------------------


@asynccontextmanager
async def tls_proxy(
    listener_files: tuple[str, str], *upstreams: Upstream, **settings: object
) -> AsyncIterator[tuple[Proxy, BoundAddresses]]:
    cert, key = listener_files
    config = config_for(*upstreams, tls_cert=cert, tls_key=key, **settings)
    proxy = Proxy(config)
    async with trio.open_nursery() as nursery:
        addresses: BoundAddresses = await nursery.start(
            functools.partial(serve, config, proxy=proxy)
        )
        yield proxy, addresses
        nursery.cancel_scope.cancel()


async def test_downstream_tls_with_httpx(listener_files: tuple[str, str], ca_file: str) -> None:
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(healthy(b"hello"))}) as fleet:
            node = await fleet.serve_tcp("a")
            verify = client_context(ca_file)
            async with (
                tls_proxy(listener_files, node) as (_, addresses),
                httpx.AsyncClient(verify=verify, trust_env=False) as client,
            ):
                first = await client.post(f"{addresses.client_url}/v1/chat", json={})
                second = await client.post(f"{addresses.client_url}/v1/chat", json={})

    assert addresses.scheme == "https"
    assert addresses.client_url == f"https://127.0.0.1:{addresses.client[1]}"
    for response in (first, second):
        assert response.status_code == 200
        assert response.text == "hello"
        assert response.http_version == "HTTP/1.1"
    assert [r.header("x-forwarded-proto") for r in fleet["a"].received] == [b"https", b"https"]


async def test_keep_alive_and_pipelining_on_one_tls_connection(
    listener_files: tuple[str, str], ca_file: str
) -> None:
    # The proxy's reader task holds one receive_some on the SSLStream for the
    # connection's whole life while responses are sent: both must keep working
    # across requests.
    def encode(conn: h11.Connection, number: int) -> bytes:
        body = b'{"n": %d}' % number
        head = [("host", "proxy.test"), ("content-length", str(len(body)))]
        return (
            conn.send(h11.Request(method="POST", target="/v1/chat", headers=head))
            + conn.send(h11.Data(data=body))
            + conn.send(h11.EndOfMessage())
        )

    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(healthy(b"ok"))}) as fleet:
            node = await fleet.serve_tcp("a")
            async with tls_proxy(listener_files, node) as (_, addresses):
                stream = await trio.open_ssl_over_tcp_stream(
                    *addresses.client,
                    ssl_context=client_context(ca_file),
                    https_compatible=True,
                )
                await stream.do_handshake()
                alpn = stream.selected_alpn_protocol()
                conn = h11.Connection(h11.CLIENT)
                await stream.send_all(encode(conn, 1))
                responses = [await read_response(stream, conn)]
                # Two more, pipelined in a single write; h11 on our side only
                # encodes one at a time, so a second client state machine
                # encodes the third.
                conn.start_next_cycle()
                pipelined = encode(conn, 2) + encode(h11.Connection(h11.CLIENT), 3)
                await stream.send_all(pipelined)
                responses.append(await read_response(stream, conn))
                conn.start_next_cycle()
                responses.append(await read_response(stream, conn))
                await stream.aclose()

    assert alpn == "http/1.1"
    assert [(r.status, r.body, r.complete) for r in responses] == [(200, b"ok", True)] * 3
    assert [r.body for r in fleet["a"].received] == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_downstream_tls_with_curl(listener_files: tuple[str, str], ca_file: str) -> None:
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(healthy(b"hello curl"))}) as fleet:
            node = await fleet.serve_tcp("a")
            async with tls_proxy(listener_files, node) as (_, addresses):
                done = await trio.run_process(
                    [
                        "curl",
                        "--silent",
                        "--show-error",
                        "--noproxy",
                        "*",
                        "--max-time",
                        "10",
                        "--cacert",
                        ca_file,
                        "--write-out",
                        "\n%{http_version} %{response_code}",
                        f"{addresses.client_url}/health",
                    ],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )

    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().splitlines() == ["hello curl", "1.1 200"]


async def test_plain_http_to_the_tls_port_is_dropped_and_the_proxy_keeps_serving(
    listener_files: tuple[str, str], ca_file: str, logged: LogRecords
) -> None:
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(healthy(b"hello"))}) as fleet:
            node = await fleet.serve_tcp("a")
            async with tls_proxy(listener_files, node) as (_, addresses):
                plain = await trio.open_tcp_stream(*addresses.client)
                await plain.send_all(b"GET /health HTTP/1.1\r\nHost: proxy.test\r\n\r\n")
                answer = b""
                with trio.fail_after(5):  # closed promptly, not left to a timeout
                    try:
                        while chunk := await plain.receive_some(65536):
                            answer += chunk
                    except trio.BrokenResourceError:
                        pass
                await plain.aclose()
                async with httpx.AsyncClient(
                    verify=client_context(ca_file), trust_env=False
                ) as client:
                    after = await client.get(f"{addresses.client_url}/health")

    assert not answer.startswith(b"HTTP/")  # at most a TLS alert, never plaintext
    assert after.status_code == 200
    assert fleet["a"].received[0].target == b"/health"
    assert len(fleet["a"].received) == 1  # the plaintext request went nowhere
    assert not logged.at(logging.ERROR)


async def test_client_that_never_finishes_the_handshake_is_closed(
    listener_files: tuple[str, str],
) -> None:
    header_timeout = 0.5
    with trio.fail_after(LIMIT):
        async with Fleet({"a": FakeNode(healthy())}) as fleet:
            node = await fleet.serve_tcp("a")
            async with tls_proxy(listener_files, node, client_header_timeout=header_timeout) as (
                _,
                addresses,
            ):
                # Taken before connecting: the proxy may accept, and start
                # its clock, before this task runs again after the connect.
                started = trio.current_time()
                silent = await trio.open_tcp_stream(*addresses.client)
                try:
                    closed = await silent.receive_some(65536)
                except trio.BrokenResourceError:
                    closed = b""
                waited = trio.current_time() - started
                await silent.aclose()

    assert closed == b""
    assert header_timeout <= waited < header_timeout + 4.5


async def test_client_fin_over_tls_still_cancels_the_attempt(
    listener_files: tuple[str, str], ca_file: str
) -> None:
    # A TLS client that just closes its socket (no close_notify) is a FIN to
    # the proxy, as over plain TCP: --client-close abort stops the attempt.
    with trio.fail_after(LIMIT):
        async with Fleet({"slow": FakeNode(slow_head(30.0))}) as fleet:
            node = await fleet.serve_tcp("slow")
            async with tls_proxy(listener_files, node) as (proxy, addresses):
                stream = await trio.open_ssl_over_tcp_stream(
                    *addresses.client, ssl_context=client_context(ca_file)
                )
                conn = h11.Connection(h11.CLIENT)
                head = [("host", "proxy.test"), ("content-length", "2")]
                await stream.send_all(
                    conn.send(h11.Request(method="POST", target="/v1/chat", headers=head))
                    + conn.send(h11.Data(data=b"{}"))
                    + conn.send(h11.EndOfMessage())
                )
                await fleet["slow"].first_request.wait()
                left = trio.current_time()
                await stream.transport_stream.aclose()
                await wait_until(lambda: bool(fleet["slow"].closed_at))
                upstream_closed = trio.current_time() - left
                await wait_until(lambda: bool(proxy.recent))

    assert upstream_closed < 5.0  # the node would have answered after 30 s
    assert proxy.recent[-1]["state"] == "cancelled"


def test_server_context_offers_http11_and_refuses_bad_files(
    listener_files: tuple[str, str], tmp_path: Path
) -> None:
    cert, key = listener_files
    node = Upstream("a", "http://127.0.0.1:9")
    assert server_ssl_context(config_for(node)) is None
    context = server_ssl_context(config_for(node, tls_cert=cert, tls_key=key))
    assert context is not None
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_RENEGOTIATION

    with pytest.raises(ConfigError, match="tls-key"):
        server_ssl_context(config_for(node, tls_key=key))
    other_key = tmp_path / "other-key.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(other_key)
    with pytest.raises(ConfigError, match="tls-cert"):
        server_ssl_context(config_for(node, tls_cert=cert, tls_key=str(other_key)))
    # An encrypted key is refused at once instead of prompting on the terminal.
    plain_key = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
    locked_key = tmp_path / "locked-key.pem"
    locked_key.write_bytes(
        plain_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    with pytest.raises(ConfigError, match="tls-cert"):
        server_ssl_context(config_for(node, tls_cert=cert, tls_key=str(locked_key)))


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGTERM")
async def test_serve_command_logs_the_https_url(listener_files: tuple[str, str]) -> None:
    cert, key = listener_files
    command = [
        sys.executable,
        "-m",
        "trio_failover",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "off",
        "--upstream",
        "a=http://127.0.0.1:9",
        "--tls-cert",
        cert,
        "--tls-key",
        key,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_FAILOVER_")}
    lines: list[str] = []
    with trio.fail_after(LIMIT):
        process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, env=env)
        try:
            assert process.stderr is not None
            buffer = b""
            while not any("listening on" in line for line in lines):
                chunk = await process.stderr.receive_some(4096)
                if not chunk:
                    break
                buffer += chunk
                *done, buffer = buffer.split(b"\n")
                lines += [line.decode() for line in done]
        finally:
            process.send_signal(signal.SIGTERM)
            await process.wait()
            if process.stderr is not None:
                await process.stderr.aclose()

    listening = [line for line in lines if "listening on" in line]
    assert len(listening) == 1, lines
    assert "listening on https://127.0.0.1:" in listening[0]
