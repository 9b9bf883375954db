"""deploy/ stays in step with the program: the systemd unit and the Kubernetes example.

- The unit passes ``systemd-analyze verify`` with nothing to say (where that
  command exists; skipped otherwise), keeps its hardening, and waits longer
  to stop than the drain's ``--shutdown-timeout``.
- The Kubernetes example is parsed (PyYAML): every flag and
  ``TRIO_FAILOVER_`` variable it uses is the proxy's, its arguments pass
  ``trio-failover check``, and its probes, ports and grace period agree.

Every flag of the example is in the option table: the shared-state flags
of SPEC section 3 were allowed there before the CLI had them (a
``PENDING`` list, now gone), and are checked like every other since.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
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
