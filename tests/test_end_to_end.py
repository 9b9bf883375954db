"""The proxy as a user meets it: real sockets, real clients (httpx, openai, curl)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
import trio

from trio_failover import Config, ConfigError, Upstream
from trio_failover.service.server import serve
from trio_failover.testing import FakeNode, Fleet, healthy
from trio_failover.testing import openai as openai_node


def refusing_upstream(name: str) -> Upstream:
    """A loopback port that nothing listens on: connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return Upstream(name, f"http://127.0.0.1:{port}")


@asynccontextmanager
async def proxy_for(
    fleet: Fleet, names: list[str], *extra: Upstream, **settings: object
) -> AsyncIterator[str]:
    upstreams = [*extra, *[await fleet.serve_tcp(name) for name in names]]
    settings.setdefault("discovery_interval", 0)  # the nodes count their requests
    config = Config(upstreams=upstreams, listen="127.0.0.1:0", admin_listen=None, **settings)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        addresses = await nursery.start(serve, config)
        yield addresses.client_url
        nursery.cancel_scope.cancel()


async def test_post_fails_over_a_refusing_node_byte_identical() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "héllo"}]}).encode()
    async with (
        Fleet({"good": FakeNode(healthy(b'{"answer": 42}'))}) as fleet,
        proxy_for(fleet, ["good"], refusing_upstream("down")) as url,
        httpx.AsyncClient() as client,
    ):
        response = await client.post(
            url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", "x-request-id": "client-id-1"},
        )
        (seen,) = fleet["good"].received
        assert seen.body == body
        assert seen.header("x-request-id") == b"client-id-1"
        assert seen.header("x-forwarded-for") == b"127.0.0.1"
        assert seen.header("x-forwarded-proto") == b"http"
        assert seen.target == b"/v1/chat/completions"
        assert response.status_code == 200
        assert response.json() == {"answer": 42}
        assert response.headers["x-request-id"] == "client-id-1"
        assert response.headers["x-failover-node"] == "good"
        assert response.headers["x-failover-attempts"] == "2"


async def test_sse_arrives_chunk_by_chunk() -> None:
    events = [b"data: %d\n\n" % i for i in range(20)]
    node = FakeNode(
        healthy(events, headers=(("content-type", "text/event-stream"),), chunk_delay=0.05)
    )
    async with Fleet({"sse": node}) as fleet, proxy_for(fleet, ["sse"]) as url:
        arrivals: list[tuple[float, bytes]] = []
        async with (
            httpx.AsyncClient() as client,
            client.stream("POST", url + "/v1/chat/completions", content=b"{}") as response,
        ):
            async for piece in response.aiter_raw():
                arrivals.append((trio.current_time(), piece))
        assert b"".join(piece for _, piece in arrivals) == b"".join(events)
        # Unbuffered: the first event is there long before the last was sent
        # (the node spends 19 x 50 ms between them).
        assert len(arrivals) >= 10
        assert arrivals[-1][0] - arrivals[0][0] > 0.6


async def test_official_openai_client_streams_through_the_proxy() -> None:
    async with Fleet({"llm": FakeNode(openai_node("qwen", tokens=6))}) as fleet:
        async with proxy_for(fleet, ["llm"], refusing_upstream("down")) as url:

            def chat() -> tuple[str, str]:
                client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
                stream = client.chat.completions.create(
                    model="qwen", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
                plain = client.chat.completions.create(
                    model="qwen", messages=[{"role": "user", "content": "hi"}]
                )
                return text, plain.choices[0].message.content or ""

            with trio.fail_after(30):
                streamed, plain = await trio.to_thread.run_sync(chat)
        assert streamed == plain == "".join(f"word{i} " for i in range(6))
        assert len(fleet["llm"].received) == 2


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_through_the_proxy() -> None:
    async with Fleet({"llm": FakeNode(openai_node("qwen"))}) as fleet:
        async with proxy_for(fleet, ["llm"]) as url:
            with trio.fail_after(30):
                result = await trio.run_process(
                    [
                        "curl",
                        "-sS",
                        "-i",
                        url + "/v1/chat/completions",
                        "-H",
                        "content-type: application/json",
                        "-d",
                        '{"model": "qwen", "messages": [], "stream": true}',
                    ],
                    capture_stdout=True,
                )
        output = result.stdout.decode()
        assert output.startswith("HTTP/1.1 200")
        assert "x-failover-node: llm" in output.lower()
        assert "data: [DONE]" in output


async def raw_exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return received


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        pytest.param(b"GARBAGE\r\n\r\n", 400, "bad_request", id="malformed-request-line"),
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: p\r\n" + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n",
            431,
            "headers_too_large",
            id="100KB-of-headers",
        ),
        pytest.param(
            b"POST / HTTP/1.1\r\nHost: p\r\nContent-Length: 2048\r\n\r\n" + b"x" * 2048,
            413,
            "request_too_large",
            id="body-over-limit",
        ),
        pytest.param(
            b"POST / HTTP/1.1\r\nHost: p\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
            "bad_request",
            id="content-length-with-transfer-encoding",
        ),
    ],
)
async def test_bad_requests_get_json_errors_and_the_proxy_keeps_serving(
    data: bytes, status: int, code: str
) -> None:
    async with (
        Fleet({"good": FakeNode(healthy(b"fine"))}) as fleet,
        proxy_for(fleet, ["good"], max_request_body=1024) as url,
    ):
        answer = await raw_exchange(url, data)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status)
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == code
        assert fleet["good"].received == []
        async with httpx.AsyncClient() as client:
            after = await client.post(url + "/", content=b"{}")
        assert after.text == "fine"


@pytest.mark.parametrize("field", ["listen", "admin_listen"])
async def test_a_taken_port_is_a_config_error_from_nursery_start(field: str) -> None:
    """Either listener: ``ConfigError`` naming its option, the ``OSError`` its cause."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addresses = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"}
        addresses[field] = f"127.0.0.1:{taken.getsockname()[1]}"
        config = Config(
            upstreams=[Upstream("a", "http://127.0.0.1:9")], discovery_interval=0, **addresses
        )
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                with pytest.raises(ConfigError) as caught:
                    await nursery.start(serve, config)
    assert caught.value.option == field.replace("_", "-")
    assert isinstance(caught.value.__cause__, OSError)


def test_run_server_with_an_embedders_loader_reports_a_taken_port() -> None:
    """A loader is any callable with a ``path``: exit 2 with the error line, whatever it lacks.

    In a process of its own: ``run_server`` sets the process's collector and logging.
    """
    program = textwrap.dedent(
        """
        import sys
        from trio_failover import Config, Upstream
        from trio_failover.service.server import run_server

        config = Config(
            upstreams=[Upstream("a", "http://127.0.0.1:9")],
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:" + sys.argv[1],
            discovery_interval=0,
        )

        def loader():
            return config

        loader.path = None
        sys.exit(run_server(config, loader=loader))
        """
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-c", program, port], capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 2, done.stderr
    assert "cannot listen (admin listener)" in done.stderr
