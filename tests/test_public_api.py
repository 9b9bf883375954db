"""The library API (docs/embedding.md): the names, their types and their behaviour.

``__all__`` is pinned here on purpose: adding or removing a public name is a
decision, and this test makes it a visible one.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_failover
from trio_failover.core import errors
from trio_failover.testing import FakeNode, Fleet, frozen, healthy, request, request_tcp

PUBLIC = [
    "AttemptRecord",
    "BoundAddresses",
    "ClientError",
    "ClientKey",
    "Config",
    "ConfigError",
    "ConnectFailed",
    "ConnectTimeout",
    "Connector",
    "DeadPeer",
    "EventBus",
    "FailoverError",
    "FirstBodyTimeout",
    "HeaderTimeout",
    "Outcome",
    "Proxy",
    "RetryableResponse",
    "Subscription",
    "TCPConnector",
    "TLSError",
    "Upstream",
    "UpstreamClosedEarly",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamReset",
    "__version__",
    "open_proxy",
    "run_server",
    "serve",
]

# Where each public name is defined: the package re-exports the same objects.
HOMES = {
    "AttemptRecord": "core.outcome",
    "BoundAddresses": "service.server",
    "ClientKey": "core.config",
    "Config": "core.config",
    "Connector": "wire.upstream",
    "EventBus": "telemetry.events",
    "Outcome": "core.outcome",
    "Proxy": "proxy",
    "Subscription": "telemetry.events",
    "TCPConnector": "wire.upstream",
    "Upstream": "core.config",
    "open_proxy": "proxy",
    "run_server": "service.server",
    "serve": "service.server",
}


def test_all_is_pinned() -> None:
    assert trio_failover.__all__ == PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_resolves_to_its_defining_object(name: str) -> None:
    value = getattr(trio_failover, name)
    home = HOMES.get(name, "core.errors" if name != "__version__" else None)
    if home is not None:
        module = importlib.import_module(f"trio_failover.{home}")
        assert value is getattr(module, name)
        assert inspect.getdoc(value), f"{name} has no docstring"


def test_star_import_and_dir_offer_exactly_the_public_names() -> None:
    namespace: dict[str, Any] = {}
    exec("from trio_failover import *", namespace)
    assert set(PUBLIC) <= set(namespace)
    assert set(PUBLIC) <= set(dir(trio_failover))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Serve'"):
        trio_failover.Serve  # type: ignore[attr-defined]  # noqa: B018


def test_version_is_the_package_version() -> None:
    assert trio_failover.__version__ == importlib.metadata.version("trio-failover")


def test_importing_the_package_does_not_import_trio() -> None:
    # Keeps `trio-failover check` and config errors fast: Trio, h11 and the
    # metrics library load only when a name that needs them is used.
    probe = (
        "import sys, trio_failover; "
        "print(sorted(m for m in ('trio', 'h11', 'prometheus_client') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_package_is_typed() -> None:
    assert Path(trio_failover.__file__).with_name("py.typed").exists()


def test_mypy_sees_the_lazy_names_with_their_types(tmp_path: Path) -> None:
    """Each line misuses one lazily imported name; mypy must flag every one.

    If a name were typed as ``Any`` (a module ``__getattr__`` visible to
    mypy), its line, and the misspelt one, would pass silently.
    """
    api = importlib.import_module("mypy.api")
    misuse = {
        "serve": "trio_failover.serve(1)",
        "run_server": "x1: str = trio_failover.run_server",
        "Proxy": "trio_failover.Proxy(1)",
        "BoundAddresses": "x2: int = trio_failover.BoundAddresses",
        "EventBus": "x3: int = trio_failover.EventBus().subscribe()",
        "Subscription": "x4: int = trio_failover.Subscription",
        "Connector": "x5: int = trio_failover.Connector",
        "TCPConnector": "trio_failover.TCPConnector(1)",
        "open_proxy": "trio_failover.open_proxy(1)",
        "a misspelt name": "trio_failover.Serve",
    }
    source = tmp_path / "use_api.py"
    source.write_text("import trio_failover\n\n" + "\n".join(misuse.values()) + "\n")
    stdout, stderr, status = api.run(
        [
            "--strict",
            "--no-error-summary",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(source),
        ]
    )
    flagged = {int(line.split(":")[1]) for line in stdout.splitlines() if ": error:" in line}
    assert flagged == set(range(3, 3 + len(misuse))), stdout + stderr
    assert status == 1


TREE = [
    (errors.ConfigError, errors.FailoverError),
    (errors.ConfigError, ValueError),
    (errors.ClientError, errors.FailoverError),
    (errors.UpstreamError, errors.FailoverError),
    *[
        (kind, errors.UpstreamError)
        for kind in (
            errors.ConnectFailed,
            errors.ConnectTimeout,
            errors.TLSError,
            errors.HeaderTimeout,
            errors.FirstBodyTimeout,
            errors.UpstreamReset,
            errors.UpstreamClosedEarly,
            errors.UpstreamProtocolError,
            errors.DeadPeer,
            errors.RetryableResponse,
        )
    ],
]


@pytest.mark.parametrize(("kind", "parent"), TREE, ids=[kind.__name__ for kind, _ in TREE])
def test_exception_tree(kind: type[Exception], parent: type[Exception]) -> None:
    assert issubclass(kind, parent)
    assert getattr(trio_failover, kind.__name__) is kind
    if issubclass(kind, errors.UpstreamError) and kind is not errors.UpstreamError:
        assert isinstance(kind.outcome, trio_failover.Outcome)


def test_exceptions_carry_their_context() -> None:
    bad = trio_failover.ConfigError("listen", "nowhere", "HOST:PORT", source="--listen")
    assert (bad.option, bad.value, bad.expected, bad.source) == (
        "listen",
        "nowhere",
        "HOST:PORT",
        "--listen",
    )
    stall = trio_failover.HeaderTimeout("gpu-a", "head", "no head in 120s")
    assert (stall.node, stall.phase, stall.outcome) == (
        "gpu-a",
        "head",
        trio_failover.Outcome.HEADER_TIMEOUT,
    )
    assert str(stall) == "gpu-a: head: no head in 120s"
    record = trio_failover.AttemptRecord("gpu-a", trio_failover.Outcome.HEADER_TIMEOUT, 120.0)
    assert record.to_json() == {
        "node": "gpu-a",
        "outcome": "header_timeout",
        "elapsed_ms": 120000.0,
    }
    with pytest.raises(trio_failover.ConfigError) as caught:
        trio_failover.Config(upstreams=[])
    assert caught.value.option == "upstream"


async def test_spec_section_7_serve_in_a_nursery() -> None:
    async with Fleet({"a": FakeNode(healthy(b"hi"))}) as fleet:
        node = await fleet.serve_tcp("a")
        config = trio_failover.Config(upstreams=[node], listen="127.0.0.1:0", admin_listen=None)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                proxy = await nursery.start(trio_failover.serve, config)
                assert isinstance(proxy, trio_failover.BoundAddresses)
                assert proxy.client[0] == "127.0.0.1"
                assert proxy.client[1] != 0
                response = await request_tcp(proxy.client, body=b'{"stream": true}')
                nursery.cancel_scope.cancel()
    assert response is not None
    assert (response.status, response.body) == (200, b"hi")


async def test_proxy_with_a_connector_reports_events_in_virtual_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with Fleet({"frozen": FakeNode(frozen()), "ok": FakeNode(healthy(b"hi"))}) as fleet:
        config = trio_failover.Config(upstreams=fleet.upstreams(), admin_listen=None)
        proxy = trio_failover.Proxy(config, connector=fleet.connector)
        assert isinstance(proxy.events, trio_failover.EventBus)
        seen: list[tuple[float, str, str, object]] = []
        with proxy.events.subscribe() as events:
            assert isinstance(events, trio_failover.Subscription)
            response = await request(
                proxy, body=b'{"stream": true}', headers=[("x-request-id", "w1")]
            )
            events.close()
            async for event in events:
                if event["type"] == "check":  # the GET /health that found it silent
                    continue
                key = "node" if event["type"] == "node" else "id"
                seen.append((trio.current_time(), event["state"], event[key], event.get("node")))
        assert events.dropped == "closed"
    assert response is not None
    assert response.at == 20.0  # silent 10 s, then 10 s for an answer to GET /health
    assert [(state, key, node) for _, state, key, node in seen] == [
        ("queued", "w1", None),
        ("running", "w1", "frozen"),
        ("down", "frozen", "frozen"),
        ("running", "w1", "ok"),
        ("committed", "w1", "ok"),
        ("completed", "w1", "ok"),
    ]
