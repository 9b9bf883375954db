"""Engine settings: --engine, --load-interval, --cold-start-timeout, auto."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from trio_failover.cli.settings import ConfigFile, describe, resolve
from trio_failover.core.config import Config, Upstream
from trio_failover.core.errors import ConfigError, ConfigErrors

TWO = {"upstream": ["a=http://h:1", "b=http://h:2"]}
FILE = """
engine = "vllm"
capacity = "auto"

[[upstream]]
name = "a"
url = "http://h:1"
engine = "ollama"
capacity = 3

[[upstream]]
name = "b"
url = "http://h:2"
"""


def toml(text: str) -> ConfigFile:
    return ConfigFile.parse(textwrap.dedent(text), "config.toml")


def engines(config: Config) -> dict[str, str]:
    return {node.name: node.engine for node in config.upstreams}


@pytest.mark.parametrize(
    ("flags", "environ", "expected", "source_b"),
    [
        pytest.param({}, {}, {"a": "auto", "b": "auto"}, "default", id="default auto"),
        pytest.param(
            {"engine": ["a=vllm"]}, {}, {"a": "vllm", "b": "auto"}, "default", id="one node"
        ),
        pytest.param(
            {"engine": ["ollama", "a=vllm"]},
            {},
            {"a": "vllm", "b": "ollama"},
            "flag --engine",
            id="bare flag for the rest",
        ),
        pytest.param(
            {"engine": ["ollama"]},
            {"TRIO_FAILOVER_ENGINES": "a=lmstudio, llama-server"},
            {"a": "lmstudio", "b": "ollama"},
            "flag --engine",
            id="named env beats bare flag",
        ),
        pytest.param(
            {"engine": ["a=llama-cpp-python"]},
            {"TRIO_FAILOVER_ENGINES": "llama-cpp-python"},
            {"a": "llama-cpp-python", "b": "llama-cpp-python"},
            "env TRIO_FAILOVER_ENGINES",
            id="llama-cpp-python",
        ),
    ],
)
def test_engine_precedence(
    flags: dict[str, Any], environ: dict[str, str], expected: dict[str, str], source_b: str
) -> None:
    config, sources = resolve({**TWO, **flags}, environ)
    assert engines(config) == expected
    assert str(sources["engine:b"]) == source_b


def test_engine_and_capacity_from_the_file() -> None:
    config, sources = resolve({}, {}, toml(FILE))
    a, b = config.upstreams
    assert (a.engine, a.capacity, b.engine, b.capacity) == ("ollama", 3, "vllm", None)
    assert str(sources["engine:a"]) == "file config.toml:8"
    assert str(sources["engine:b"]) == "file config.toml:2"
    assert str(sources["capacity:b"]) == "file config.toml:3"


def test_check_shows_engine_capacity_and_their_sources() -> None:
    config, sources = resolve({**TWO, "capacity": ["a=2"], "engine": ["b=vllm"]}, {})
    rows = {row[0]: row[1:] for row in describe(config, sources)}
    assert rows["capacity a"] == ("2", "flag --capacity")
    assert rows["capacity b"] == ("auto", "default")
    assert rows["engine a"] == ("auto", "default")
    assert rows["engine b"] == ("vllm", "flag --engine")
    assert rows["load-interval"] == ("2s", "default")
    assert rows["cold-start-timeout"] == ("5m", "default")


def test_load_interval_and_cold_start_timeout() -> None:
    config, _ = resolve({**TWO, "load_interval": "0"}, {"TRIO_FAILOVER_COLD_START_TIMEOUT": "90s"})
    assert (config.load_interval, config.cold_start_timeout) == (0.0, 90.0)
    config, _ = resolve({}, {}, toml(FILE + '\n[timeouts]\ncold_start = "1m"\n'))
    assert config.cold_start_timeout == 60.0


def _only_mistake(flags: dict[str, Any], environ: dict[str, str], file: ConfigFile | None) -> Any:
    with pytest.raises(ConfigError) as info:
        resolve(flags, environ, file)
    got = info.value
    assert not isinstance(got, ConfigErrors), str(got)
    return (got.source, got.option, got.value)


@pytest.mark.parametrize(
    ("flags", "environ", "text", "expected"),
    [
        pytest.param(
            {**TWO, "engine": ["a=tgi"]}, {}, None, ("--engine", "engine", "a=tgi"), id="kind"
        ),
        pytest.param(
            {**TWO, "engine": ["c=vllm"]}, {}, None, ("--engine", "engine", "c=vllm"), id="node"
        ),
        pytest.param(
            TWO,
            {"TRIO_FAILOVER_ENGINES": "=vllm"},
            None,
            ("TRIO_FAILOVER_ENGINES", "engine", "=vllm"),
            id="no name",
        ),
        pytest.param(
            {**TWO, "engine": ["vllm", "ollama"]},
            {},
            None,
            ("--engine", "engine", "ollama"),
            id="bare twice",
        ),
        pytest.param(
            {**TWO, "capacity": ["a=automatic"]},
            {},
            None,
            ("--capacity", "capacity", "a=automatic"),
            id="capacity word",
        ),
        pytest.param(
            {**TWO, "load_interval": "2"},
            {},
            None,
            ("--load-interval", "load-interval", "2"),
            id="interval without unit",
        ),
        pytest.param(
            TWO,
            {"TRIO_FAILOVER_COLD_START_TIMEOUT": "-5m"},
            None,
            ("TRIO_FAILOVER_COLD_START_TIMEOUT", "cold-start-timeout", "-5m"),
            id="cold start negative",
        ),
        pytest.param(
            {},
            {},
            '[[upstream]]\nurl = "http://h:1"\nengine = "Ollama"\n',
            ("config.toml:3", "upstream.engine", "Ollama"),
            id="file kind",
        ),
        pytest.param(
            {},
            {},
            'capacity = "many"\n[[upstream]]\nurl = "http://h:1"\n',
            ("config.toml:1", "capacity", "many"),
            id="file capacity word",
        ),
    ],
)
def test_bad_engine_settings_name_option_source_and_value(
    flags: dict[str, Any], environ: dict[str, str], text: str | None, expected: tuple[str, ...]
) -> None:
    file = None if text is None else ConfigFile.parse(text, "config.toml")
    assert _only_mistake(flags, environ, file) == expected


def test_the_library_refuses_an_unknown_engine_kind() -> None:
    with pytest.raises(ConfigError, match="one of auto, openai"):
        Upstream("a", "http://h:1", engine="tgi")
    assert Upstream("a", "http://h:1").capacity is None  # auto
