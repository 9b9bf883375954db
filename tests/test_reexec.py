"""``serve`` hands its resolved settings to a fresh process image (reexec.py)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import trio
from support import serve_process

from trio_failover import Config, Upstream
from trio_failover.cli import reexec
from trio_failover.testing import FakeNode, Fleet, healthy, request_tcp

has_memfd = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or not Path("/proc/self/maps").exists(),
    reason="the fresh image needs memfd_create (Linux); elsewhere serve runs in place",
)


@has_memfd
async def test_serve_runs_without_the_command_line_imports() -> None:
    async with Fleet({"a": FakeNode(healthy(b"ok"))}) as fleet:
        node = await fleet.serve_tcp("a")
        async with serve_process(f"--upstream=a={node.url}") as proxy:
            pid = proxy.process.pid
            # typer's pydantic, loaded to parse the flags, is not in the image that serves.
            maps = await trio.Path(f"/proc/{pid}/maps").read_text()
            assert "pydantic_core" not in maps
            arguments = (await trio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
            assert b"trio_failover.cli.reexec" in arguments
            # ps still shows what was asked for.
            assert f"--upstream=a={node.url}".encode() in arguments
            response = await request_tcp(proxy.address, body=b"{}")
            assert response is not None
            assert (response.status, response.body) == (200, b"ok")


def test_the_config_survives_the_handover() -> None:
    config = Config(
        upstreams=[
            Upstream(
                "gpu-a",
                "https://user:pw@10.0.0.5:8443/ollama/",
                models={"qwen3:32b": "Qwen/Qwen3-32B"},
                headers={"Authorization": "Bearer sk-node-key"},
                ca_file="/etc/ca.pem",
            ),
            Upstream("gpu-b", "http://[::1]:8000", models=["llama3:8b"]),
        ],
        response_header_timeout=7.5,
        retry_status=[429, 503],
        affinity="off",
        admin_listen=None,
    )
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    for before, after in zip(config.upstreams, copy.upstreams, strict=True):
        # Not part of equality (eq=False), so checked one by one.
        assert after.headers == before.headers
        parts = ("scheme", "host", "port", "base_path", "host_header")
        assert [getattr(after, part) for part in parts] == [getattr(before, part) for part in parts]


def test_without_memfd_serve_stays_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(os, "execv", lambda *args: pytest.fail("exec without memfd"))
    assert (
        reexec.exec_serve(
            Config(upstreams=[Upstream("a", "http://127.0.0.1:1")]), ["trio-failover"]
        )
        is None
    )


@has_memfd
def test_a_failed_exec_falls_back_and_closes_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[int] = []
    real_memfd_create = os.memfd_create

    def memfd_create(name: str, flags: int = 0) -> int:
        opened.append(real_memfd_create(name, flags))
        return opened[-1]

    def execv(*args: object) -> None:
        raise PermissionError("exec refused")

    monkeypatch.setattr(os, "memfd_create", memfd_create)
    monkeypatch.setattr(os, "execv", execv)
    assert (
        reexec.exec_serve(
            Config(upstreams=[Upstream("a", "http://127.0.0.1:1")]), ["trio-failover"]
        )
        is None
    )
    (fd,) = opened
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_no_exec_when_the_new_image_would_import_another_copy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A zipapp, or a checkout run with python -m from its folder while
    # another copy is installed: the new image must not serve other code.
    package_root = str(Path(reexec.__file__).parent.parent.parent)
    monkeypatch.setattr(sys, "path", [package_root, str(tmp_path)])
    assert not reexec._new_image_imports_this_package()
    other = tmp_path / "trio_failover"
    other.mkdir()
    (other / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [package_root, str(tmp_path), package_root])
    assert not reexec._new_image_imports_this_package()  # the other copy comes first
    monkeypatch.setattr(sys, "path", [str(tmp_path), package_root])
    assert reexec._new_image_imports_this_package()
    monkeypatch.setattr(os, "execv", lambda *args: pytest.fail("exec to another copy"))
    monkeypatch.setattr(sys, "path", [package_root])
    config = Config(upstreams=[Upstream("a", "http://127.0.0.1:1")])
    assert reexec.exec_serve(config, ["trio-failover"]) is None
