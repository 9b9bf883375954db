"""The shared state's settings: --state, --state-prefix, --lease-ttl,
--state-timeout, --workers; their sources, bad values, and ``check``'s listing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from trio_failover.cli.settings import ConfigFile, describe, resolve
from trio_failover.core.config import Config, Upstream
from trio_failover.core.errors import ConfigError

NODE = {"upstream": ["http://127.0.0.1:9001"]}
REDIS = "redis://127.0.0.1:6379"


def toml(text: str) -> ConfigFile:
    return ConfigFile.parse(textwrap.dedent(text).lstrip("\n"), "config.toml")


def test_defaults() -> None:
    config, _ = resolve(NODE, {})
    assert (config.state, config.state_prefix) == ("memory", "trio-failover:")
    assert (config.lease_ttl, config.state_timeout, config.workers) == (30.0, 0.25, 1)


# name, text -> value (the same from a flag and from the environment).
TEXT_VALUES: list[tuple[str, str, object]] = [
    ("state", "memory", "memory"),
    ("state", " redis://10.0.0.5:6379/2 ", "redis://10.0.0.5:6379/2"),
    ("state", "rediss://app:s3cret@redis:6380", "rediss://app:s3cret@redis:6380"),
    ("state_prefix", "fleet-a:", "fleet-a:"),
    ("lease_ttl", "5s", 5.0),
    ("state_timeout", "100ms", 0.1),
    ("workers", "1", 1),
]


@pytest.mark.parametrize(("name", "text", "value"), TEXT_VALUES)
def test_text_values(name: str, text: str, value: object) -> None:
    config, sources = resolve({**NODE, name: text}, {})
    assert getattr(config, name) == value
    env = "TRIO_FAILOVER_" + name.upper()
    config, sources = resolve(NODE, {env: text})
    assert getattr(config, name) == value
    assert str(sources[name]) == f"env {env}"


def test_the_file_keys() -> None:
    file = toml(
        """
        state = "redis://redis:6379"
        state_prefix = "b:"
        lease_ttl = "10s"
        workers = 2

        [timeouts]
        state = "50ms"

        [[upstream]]
        url = "http://127.0.0.1:9001"
        """
    )
    config, sources = resolve({}, {}, file)
    assert (config.state, config.state_prefix, config.lease_ttl) == ("redis://redis:6379", "b:", 10)
    assert (config.state_timeout, config.workers) == (0.05, 2)
    assert str(sources["state_timeout"]) == "file config.toml:7"


# flags -> the start of the one error line (option, source, value as shown).
BAD: list[tuple[dict[str, str], str]] = [
    ({"state": "redis"}, "--state: invalid value 'redis'"),
    ({"state": "http://h:1"}, "--state: invalid value 'http://h:1'"),
    # A password never shows, even in a URL that is wrong elsewhere.
    ({"state": "redis://u:hunter2@h:1?db=2"}, "--state: invalid value 'redis://u:***@h:1?db=2'"),
    ({"state_prefix": "a b"}, "--state-prefix: invalid value 'a b'"),
    ({"state_prefix": ""}, "--state-prefix: invalid value ''"),
    ({"lease_ttl": "0"}, "--lease-ttl: invalid value '0'"),
    ({"lease_ttl": "30"}, "--lease-ttl: invalid value '30'"),
    ({"state_timeout": "0"}, "--state-timeout: invalid value '0'"),
    ({"workers": "0"}, "--workers: invalid value '0'"),
    ({"workers": "two"}, "--workers: invalid value 'two'"),
    ({"workers": "2"}, "--workers: invalid value '2' for workers: more than one worker needs"),
]


@pytest.mark.parametrize(("flags", "start"), BAD)
def test_bad_values_name_the_option_source_and_value(flags: dict[str, str], start: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve({**NODE, **flags}, {})
    assert str(caught.value).startswith(start)
    assert "hunter2" not in str(caught.value)


def test_workers_above_one_need_a_shared_state_from_any_source() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve(NODE, {"TRIO_FAILOVER_WORKERS": "3"})
    assert caught.value.source == "TRIO_FAILOVER_WORKERS"
    assert "--state redis://" in caught.value.expected
    config, _ = resolve({**NODE, "workers": "3"}, {"TRIO_FAILOVER_STATE": REDIS})
    assert config.workers == 3
    # The library's Config says the same.
    with pytest.raises(ConfigError):
        Config(upstreams=[Upstream("a", "http://127.0.0.1:1")], workers=2)


def test_check_lists_them_with_the_password_masked() -> None:
    flags = {**NODE, "state": "redis://app:hunter2@redis:6379/1", "workers": "2"}
    config, sources = resolve(flags, {})
    rows = {option: (value, source) for option, value, source in describe(config, sources)}
    assert rows["state"] == ("redis://app:***@redis:6379/1", "flag --state")
    assert rows["state-prefix"] == ("trio-failover:", "default")
    assert rows["lease-ttl"] == ("30s", "default")
    assert rows["state-timeout"] == ("250ms", "default")
    assert rows["workers"] == ("2", "flag --workers")
    assert "hunter2" not in repr(config)


def test_a_redis_state_without_hiredis_exits_2_naming_the_extra() -> None:
    code = (
        "import sys; sys.modules['hiredis'] = None; "
        "from trio_failover.cli.cli import main; sys.argv = ['trio-failover', 'check', "
        f"'--upstream=http://127.0.0.1:9', '--state={REDIS}']; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr.startswith("trio-failover: error: --state: invalid value")
    assert "the redis extra: pip install hiredis" in done.stderr
