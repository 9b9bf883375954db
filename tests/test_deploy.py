"""deploy/ keeps in step with the program: systemd unit, Kubernetes example, health check.

- The unit passes ``systemd-analyze verify`` with nothing to say (where that
  command exists; skipped otherwise), keeps its hardening, and waits longer
  to stop than the drain's ``--shutdown-timeout``.
- The Kubernetes example is parsed (PyYAML): every flag and
  ``TRIO_FAILOVER_`` variable it uses is the proxy's, its arguments pass
  ``trio-failover check``, and its probes, ports and grace period agree;
  its image is the one ``docker build -t trio-failover:VERSION .`` makes.
- The image's health check (``deploy/healthcheck.py``) finds the admin
  listener from ``TRIO_FAILOVER_ADMIN_LISTEN``; tests/test_release.py runs
  it against the proxy the image runs.

Every flag of the example is in the option table, the shared-state flags
included: none is let through because the CLI does not have it yet.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from trio_failover.cli.cli import app
from trio_failover.cli.settings.options import OPTIONS
from trio_failover.core.redis_url import parse_redis_url
from trio_failover.core.units import parse_duration

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNIT = DEPLOY / "trio-failover.service"
KUBERNETES = DEPLOY / "kubernetes" / "trio-failover.yaml"
HEALTHCHECK = DEPLOY / "healthcheck.py"
VERSION = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"][
    "version"
]
FLAGS = {option.flag: option for option in OPTIONS}
ENVS = {option.env for option in OPTIONS}
SHUTDOWN_DEFAULT = parse_duration(FLAGS["--shutdown-timeout"].default_text)


# -- the systemd unit --------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    """``Key=value`` lines of the unit (comments skipped), every value of each key."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart's program exists: point it at this venv's.
    program = Path(sys.executable).parent / "trio-failover"
    assert program.exists()
    text = UNIT.read_text(encoding="utf-8")
    assert "ExecStart=/opt/trio-failover/bin/trio-failover " in text
    unit = tmp_path / "trio-failover.service"
    unit.write_text(text.replace("/opt/trio-failover/bin/trio-failover", str(program)))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    # Unknown keys and unparsable values are only warnings: none is allowed.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_unit_is_hardened_and_keeps_its_keys_in_an_environment_file() -> None:
    settings = unit_settings()
    for key, value in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("DynamicUser", "yes"),
        ("CapabilityBoundingSet", ""),
        ("KillSignal", "SIGTERM"),
    ]:
        assert settings.get(key) == [value], key
    assert settings["RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX AF_NETLINK"]
    assert settings["EnvironmentFile"] == ["/etc/trio-failover/keys.env"]
    assert "--api-key" not in settings["ExecStart"][0]
    assert "--admin-token" not in settings["ExecStart"][0]


def test_unit_waits_longer_to_stop_than_the_drain() -> None:
    settings = unit_settings()
    (stop,) = settings["TimeoutStopSec"]
    drain = SHUTDOWN_DEFAULT
    for argument in settings["ExecStart"][0].split():
        if argument.startswith("--shutdown-timeout="):
            drain = parse_duration(argument.partition("=")[2])
    assert parse_duration(stop) > drain


# -- the Kubernetes example --------------------------------------------------------------


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """The example's objects by (kind, name)."""
    objects = [item for item in yaml.safe_load_all(KUBERNETES.read_text(encoding="utf-8")) if item]
    return {(item["kind"], item["metadata"]["name"]): item for item in objects}


def proxy_container() -> dict[str, Any]:
    spec = manifests()["Deployment", "trio-failover"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert isinstance(container, dict)
    return container


def flag_values() -> list[tuple[str, str]]:
    """The proxy's ``--flag=value`` arguments, after the ``serve`` command."""
    args = proxy_container()["args"]
    assert args[0] == "serve"
    pairs = []
    for argument in args[1:]:
        assert isinstance(argument, str), f"not a string in YAML: {argument!r}"
        flag, equals, value = argument.partition("=")
        assert flag.startswith("--"), argument
        assert equals, f"write {argument!r} as --flag=value"
        pairs.append((flag, value))
    return pairs


def test_example_uses_only_the_proxys_flags_and_variables() -> None:
    unknown = [flag for flag, _ in flag_values() if flag not in FLAGS]
    assert unknown == []
    envs = [item["name"] for item in proxy_container()["env"]]
    assert envs
    assert [name for name in envs if name not in ENVS] == []


def test_example_shares_the_fleet_through_redis() -> None:
    values = dict(flag_values())
    assert values["--state"].startswith("redis://")
    for flag in ("--state-prefix", "--lease-ttl", "--state-timeout"):
        assert flag in values, flag


def test_example_arguments_pass_check() -> None:
    secret = manifests()["Secret", "trio-failover-keys"]["stringData"]
    env = {
        item["name"]: secret[item["valueFrom"]["secretKeyRef"]["key"]]
        for item in proxy_container()["env"]
    }
    args = [f"{flag}={value}" for flag, value in flag_values()]
    result = CliRunner().invoke(app, ["check", *args], env=env)
    assert result.exit_code == 0, result.output


def test_example_probes_ports_and_grace_agree() -> None:
    objects = manifests()
    deployment = objects["Deployment", "trio-failover"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = proxy_container()
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    values = dict(flag_values())
    assert values["--listen"].rpartition(":")[2] == str(ports["http"])
    assert values["--admin-listen"].rpartition(":")[2] == str(ports["admin"])
    # Readiness on the admin listener's /healthz, which turns 503 on drain.
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", "admin")
    assert "livenessProbe" not in container
    drain = parse_duration(
        values.get("--shutdown-timeout", FLAGS["--shutdown-timeout"].default_text)
    )
    assert pod["terminationGracePeriodSeconds"] > drain
    service = objects["Service", "trio-failover"]["spec"]
    assert service["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {port["targetPort"] for port in service["ports"]} == {"http"}


def test_example_state_url_names_its_redis_service() -> None:
    objects = manifests()
    address = parse_redis_url(dict(flag_values())["--state"])
    redis = objects["Service", address.host]["spec"]
    assert [port["port"] for port in redis["ports"]] == [address.port]
    assert redis["selector"] == objects["Deployment", "redis"]["spec"]["selector"]["matchLabels"]


def test_example_runs_the_image_this_repository_builds() -> None:
    # README and docs/deploying.md: docker build -t trio-failover:VERSION .
    assert proxy_container()["image"] == f"trio-failover:{VERSION}"


# -- the image's health check ---------------------------------------------------------------


def healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("healthcheck", HEALTHCHECK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("127.0.0.1:8081", "http://127.0.0.1:8081/healthz"),
        ("0.0.0.0:8081", "http://127.0.0.1:8081/healthz"),
        (":9000", "http://127.0.0.1:9000/healthz"),
        ("[::]:8081", "http://[::1]:8081/healthz"),
        ("[::1]:8081", "http://[::1]:8081/healthz"),
        ("admin.internal:8081", "http://admin.internal:8081/healthz"),
    ],
)
def test_healthcheck_asks_the_admin_listener_on_loopback(listen: str, url: str) -> None:
    assert healthcheck().healthz_url(listen) == url


@pytest.mark.parametrize("listen", ["8081", "127.0.0.1:", "127.0.0.1:http"])
def test_healthcheck_refuses_an_address_without_a_port(listen: str) -> None:
    with pytest.raises(ValueError, match="TRIO_FAILOVER_ADMIN_LISTEN"):
        healthcheck().healthz_url(listen)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize(
    ("listen", "why"),
    [
        ("off", "the admin listener is off"),
        ("127.0.0.1:", "is not HOST:PORT"),
        ("closed", "Connection refused"),
    ],
)
def test_healthcheck_fails_without_an_answer(
    listen: str, why: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if listen == "closed":
        listen = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("TRIO_FAILOVER_ADMIN_LISTEN", listen)
    assert healthcheck().main() == 1
    assert why in capsys.readouterr().err
