"""The soak's own machinery (``scripts/soak.py``): its fake nodes and its proxy options.

The soak is a measurement that CI does not run; these checks keep it
runnable: its nodes answer the proxy's own questions (discovery's and the
fleet list routes' ``GET``s) as well as the soak's requests, and a stall it
injects costs less than its client's own timeout.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import h11
import pytest
import trio
import trio.testing

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


async def exchange(
    stream: trio.abc.Stream, conn: h11.Connection, request: h11.Request, body: bytes = b""
) -> tuple[int, bytes]:
    events = [request, *([h11.Data(data=body)] if body else []), h11.EndOfMessage()]
    await stream.send_all(b"".join(conn.send(event) or b"" for event in events))
    status, received = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(65536)))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            received += event.data
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status, received
        else:
            raise AssertionError(event)


async def test_a_node_answers_the_proxy_s_gets_then_a_spec_on_one_connection(
    soak: ModuleType, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = soak.Fleet(random.Random(1), 0.0, 2.0)
    near, far = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    host = [("host", "node.test")]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fleet.serve_connection, "a", far)
        answers = [
            await exchange(near, conn, h11.Request(method="GET", target=path, headers=host))
            for path in ("/health", "/v1/models", "/api/tags")
        ]
        spec = soak.Spec(id="s-1", chunks=2, size=16, chunked=True, delay=0.0)
        body = spec.body()
        head = [*host, ("content-length", str(len(body)))]
        post = h11.Request(method="POST", target="/v1/chat/completions", headers=head)
        answered = await exchange(near, conn, post, body)
        await near.aclose()
    assert [status for status, _ in answers] == [200, 200, 404]
    assert json.loads(answers[1][1]) == {"object": "list", "data": []}
    assert answered == (200, spec.answer())
    assert fleet.checks == {"/health": 1, "/v1/models": 1, "/api/tags": 1}
    assert fleet.served == {"a": 1}


def test_a_stall_costs_less_than_the_client_waits(soak: ModuleType) -> None:
    # The soak's requests are unstreamed: the proxy waits for a stalled
    # node's head up to --unstreamed-timeout (10 min unless set).
    command = soak.proxy_command({"a": 1}, 4.0, [])
    [option] = [arg for arg in command if arg.startswith("--unstreamed-timeout=")]
    seconds = float(option.partition("=")[2].removesuffix("s"))
    assert seconds * len(soak.FAULTY) < soak.REQUEST_TIMEOUT
