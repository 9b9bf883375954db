"""Reloads of a served proxy: the file again, SIGHUP, --watch-config, TLS, check --admin."""

from __future__ import annotations

import signal
import ssl
import sys
from pathlib import Path

import pytest
import trio
import trustme
from conftest import LogRecords
from support import serve_process
from typer.testing import CliRunner

from trio_failover.cli.cli import app
from trio_failover.cli.compare import compare_with_running
from trio_failover.cli.loader import SettingsLoader
from trio_failover.proxy import Proxy
from trio_failover.service.reloader import ListenerTLS, Reloader, tls_digest
from trio_failover.service.server import serve, server_ssl_context
from trio_failover.testing import FakeNode, Fleet, healthy, request_tcp

NODE_A = '[[upstream]]\nname = "a"\nurl = "{a}"\n'
NODE_B = '[[upstream]]\nname = "b"\nurl = "{b}"\ncapacity = 2\n'


def loader_for(path: Path) -> SettingsLoader:
    return SettingsLoader({"config": str(path)}, str(path))


def make_reloader(path: Path) -> Reloader:
    load = loader_for(path)
    config = load()
    tls = ListenerTLS(server_ssl_context(config), tls_digest(config))
    return Reloader(Proxy(config), load, tls, server_ssl_context)


async def test_an_invalid_file_changes_nothing_and_says_what_check_says(
    tmp_path: Path, logged: LogRecords
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(NODE_A.format(a="http://127.0.0.1:9001"))
    reloader = make_reloader(path)
    running = reloader.proxy.config
    path.write_text(NODE_A.format(a="http://127.0.0.1:9001") + 'capacity = "2"\n[[upstreams]]\n')
    with reloader.proxy.events.subscribe(0) as events:
        result = await reloader.reload()
        event = events.receive.receive_nowait()
    checked = CliRunner().invoke(app, ["check", "--config", str(path)])
    assert checked.exit_code == 2
    startup_lines = (
        checked.stderr.splitlines() if checked.stderr_bytes else checked.output.splitlines()
    )
    logged_lines = [
        r.getMessage() for r in logged.records if r.getMessage().startswith("trio-failover: error:")
    ]
    assert logged_lines == startup_lines
    assert len(logged_lines) == 2  # the quoted number and the misspelt table
    # Each mistake is logged once: the refusal's own line counts them.
    told = [r.getMessage() + str(getattr(r, "fields", "")) for r in logged.records]
    assert sum("did you mean [[upstream]]" in line for line in told) == 1
    refused = [r for r in logged.records if r.getMessage() == "reload refused"]
    assert [getattr(r, "fields", None) for r in refused] == [{"mistakes": 2}]
    assert not result.ok
    assert event == {"type": "reload", "ok": False, "changes": [], "error": " ".join(startup_lines)}
    assert reloader.proxy.config is running


async def test_the_file_read_again_changes_the_fleet(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(NODE_A.format(a="http://127.0.0.1:9001"))
    reloader = make_reloader(path)
    path.write_text(
        NODE_A.format(a="http://127.0.0.1:9001") + NODE_B.format(b="http://127.0.0.1:9002")
    )
    dry = await reloader.reload(dry_run=True)
    assert dry.changes == ("node b added",)
    assert len(reloader.proxy.config.upstreams) == 1
    result = await reloader.reload()
    assert result.changes == ("node b added",)
    assert [n["name"] for n in reloader.proxy.status()["nodes"]] == ["a", "b"]


async def test_watch_config_reloads_when_the_file_changes(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(NODE_A.format(a="http://127.0.0.1:9001"))
    reloader = make_reloader(path)
    with trio.fail_after(60), reloader.proxy.events.subscribe(0) as events:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reloader.watch_file, str(path))
            await trio.sleep(5.5)  # between two looks
            path.write_text(
                NODE_A.format(a="http://127.0.0.1:9001") + NODE_B.format(b="http://127.0.0.1:9002")
            )
            event = await events.receive.receive()
            assert trio.current_time() == 6.0  # the next look, a second apart
            path.unlink()  # a rename under way: waits, no reload
            await trio.sleep(3)
            path.write_text(NODE_A.format(a="http://127.0.0.1:9003"))
            second = await events.receive.receive()
            nursery.cancel_scope.cancel()
    assert event["changes"] == ["node b added"]
    assert second["changes"] == ["node b removed", "node a: url changed"]


async def test_a_file_a_sighup_reloaded_is_not_reloaded_again_by_the_watch(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(NODE_A.format(a="http://127.0.0.1:9001"))
    reloader = make_reloader(path)
    with trio.fail_after(60), reloader.proxy.events.subscribe(0) as events:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reloader.watch_file, str(path))
            await trio.sleep(5.5)  # between two looks
            path.write_text(NODE_A.format(a="http://127.0.0.1:9003"))
            await reloader.reload()  # a SIGHUP, before the watch's next look
            first = events.receive.receive_nowait()
            await trio.sleep(3)  # three looks later
            with pytest.raises(trio.WouldBlock):
                events.receive.receive_nowait()
            nursery.cancel_scope.cancel()
    assert first["changes"] == ["node a: url changed"]


async def test_a_renewed_certificate_is_loaded_for_new_handshakes(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.issue_cert("127.0.0.1").cert_chain_pems[0].write_to_path(str(cert))
    ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(key))
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    path = tmp_path / "config.toml"
    path.write_text(
        f'tls_cert = "{cert}"\ntls_key = "{key}"\n' + NODE_A.format(a="http://127.0.0.1:9001")
    )
    reloader = make_reloader(path)
    first = reloader.tls.context
    assert (await reloader.reload()).changes == ()
    assert reloader.tls.context is first  # same files: not loaded again
    renewed = ca.issue_cert("127.0.0.1")
    renewed.cert_chain_pems[0].write_to_path(str(cert))
    renewed.private_key_pem.write_to_path(str(key))
    assert (await reloader.reload()).changes == ("tls certificate files changed",)
    assert isinstance(reloader.tls.context, ssl.SSLContext)
    assert reloader.tls.context is not first
    key.write_text("not a key")
    broken = await reloader.reload()
    assert not broken.ok
    assert f"{path}:1: " in (broken.error or "")  # where the certificate was set
    assert "tls_cert" in (broken.error or "")
    assert reloader.tls.context is not first  # the renewed one stays


async def test_check_admin_prints_what_a_reload_would_change(tmp_path: Path) -> None:
    async with Fleet({"a": FakeNode(healthy())}) as fleet:
        node = await fleet.serve_tcp("a")
        path = tmp_path / "config.toml"
        text = (
            'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
            '[[client]]\nname = "al"\nkey = "secret-1"\n'
            '[[client]]\nname = "bo"\nkey = "secret-kept"\n' + NODE_A.format(a=node.url)
        )
        path.write_text(text)
        config = loader_for(path)()
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve, config)
            url = bound.admin_url
            path.write_text(
                "max_queue = 5\n"
                + text.replace("secret-1", "secret-2")
                + NODE_B.format(b="http://127.0.0.1:9002")
            )
            lines: list[str] = []
            status = await trio.to_thread.run_sync(
                compare_with_running, loader_for(path)(), url, lines.append
            )
            nursery.cancel_scope.cancel()
    assert status == 0
    assert lines[1:] == [
        f"a reload of {url} would change:",
        "  node b added",
        "  client al: key rotated",
        "  max_queue: 1000 -> 5",
    ]
    assert not any("secret" in line for line in lines)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_sighup_reloads_a_serving_process(tmp_path: Path) -> None:
    async with Fleet({"a": FakeNode(healthy(b"A")), "b": FakeNode(healthy(b"B"))}) as fleet:
        a, b = await fleet.serve_tcp("a"), await fleet.serve_tcp("b")
        path = tmp_path / "config.toml"
        path.write_text(NODE_A.format(a=a.url))
        with trio.fail_after(20):
            async with serve_process(f"--config={path}") as proxy:
                path.write_text(NODE_A.format(a=a.url) + NODE_B.format(b=b.url))
                proxy.process.send_signal(signal.SIGHUP)
                line = await proxy.lines.wait_for("reloaded")
                assert "node b added" in line
                answer = await request_tcp(proxy.address, headers=[("x-failover-node", "b")])
                assert answer is not None
                assert answer.body == b"B"
                path.write_text(NODE_A.format(a=a.url) + "capacity = -1\n")
                proxy.process.send_signal(signal.SIGHUP)
                mistake = await proxy.lines.wait_for("trio-failover: error:")
                assert "capacity" in mistake
                refused = await proxy.lines.wait_for("reload refused")
                assert "capacity" not in refused  # said once, in the line above
                assert "mistakes=1" in refused
                assert proxy.process.poll() is None  # still serving
                again = await request_tcp(proxy.address, headers=[("x-failover-node", "b")])
                assert again is not None
                assert again.body == b"B"
