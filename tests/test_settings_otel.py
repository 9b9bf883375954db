"""``--otel-endpoint``: its sources, OpenTelemetry's own variable, bad values."""

from __future__ import annotations

import textwrap

import pytest

from trio_failover.cli.settings import ConfigFile, describe, resolve
from trio_failover.core.errors import ConfigError

NODE = {"upstream": ["http://127.0.0.1:9001"]}
OURS = "TRIO_FAILOVER_OTEL_ENDPOINT"
THEIRS = "OTEL_EXPORTER_OTLP_ENDPOINT"
FILE = textwrap.dedent(
    """
    otel_endpoint = "http://file:4318"

    [[upstream]]
    url = "http://127.0.0.1:9001"
    """
).lstrip()

# flag, our variable, the file, OpenTelemetry's variable -> value, source.
# This program's own settings win over the variable meant for every
# program of a host; "off" turns traces off whatever it says.
SOURCES: list[tuple[str | None, str | None, bool, str | None, str | None, str]] = [
    (None, None, False, None, None, "default"),
    (None, None, False, "http://otel:4318", "http://otel:4318", f"env {THEIRS}"),
    (None, None, False, "", None, "default"),  # empty means unset, as for the SDK
    (None, None, True, "http://otel:4318", "http://file:4318", "file config.toml:1"),
    (None, "http://ours:4318", True, "http://otel:4318", "http://ours:4318", f"env {OURS}"),
    (
        "http://flag:4318",
        "http://ours:4318",
        True,
        None,
        "http://flag:4318",
        "flag --otel-endpoint",
    ),
    ("off", None, False, "http://otel:4318", None, "flag --otel-endpoint"),
    (None, "OFF", False, "http://otel:4318", None, f"env {OURS}"),
    (
        "https://[::1]:4318/otlp/",
        None,
        False,
        None,
        "https://[::1]:4318/otlp/",
        "flag --otel-endpoint",
    ),
]


@pytest.mark.parametrize(("flag", "ours", "use_file", "theirs", "value", "source"), SOURCES)
def test_sources(
    flag: str | None,
    ours: str | None,
    use_file: bool,
    theirs: str | None,
    value: str | None,
    source: str,
) -> None:
    flags = {**NODE, "otel_endpoint": flag} if not use_file else {"otel_endpoint": flag}
    environ = {name: text for name, text in ((OURS, ours), (THEIRS, theirs)) if text is not None}
    file = ConfigFile.parse(FILE, "config.toml") if use_file else None
    config, sources = resolve(flags, environ, file)
    assert config.otel_endpoint == value
    assert str(sources["otel_endpoint"]) == source


BAD = [
    ({"otel_endpoint": "127.0.0.1:4318"}, {}, "--otel-endpoint", "127.0.0.1:4318"),
    ({"otel_endpoint": "grpc://collector:4317"}, {}, "--otel-endpoint", "grpc://collector:4317"),
    ({}, {OURS: "http://"}, OURS, "http://"),
    ({}, {THEIRS: "collector:4318"}, THEIRS, "collector:4318"),
    ({"otel_endpoint": "http://[::1"}, {}, "--otel-endpoint", "http://[::1"),
]
NO_HOST = "expected an http:// or https:// URL with a host"
BAD_PORT = "expected a URL whose port, if any, is from 1 to 65535"


@pytest.mark.parametrize(
    ("flags", "environ", "source", "value", "expected"),
    [
        *((*case, NO_HOST) for case in BAD),
        (
            {"otel_endpoint": "http://127.0.0.1:99999"},
            {},
            "--otel-endpoint",
            "http://127.0.0.1:99999",
            BAD_PORT,
        ),
        ({}, {OURS: "http://h:0"}, OURS, "http://h:0", BAD_PORT),
        ({}, {THEIRS: "https://h:x1"}, THEIRS, "https://h:x1", BAD_PORT),
    ],
)
def test_bad_urls_name_the_option_source_and_value(
    flags: dict[str, str], environ: dict[str, str], source: str, value: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve({**NODE, **flags}, environ)
    error = info.value
    assert (error.source, error.option, error.value) == (source, "otel-endpoint", value)
    assert str(error) == (f"{source}: invalid value {value!r} for otel-endpoint: {expected}")


def test_a_file_value_must_be_a_string() -> None:
    text = FILE.replace('"http://file:4318"', "4318")
    with pytest.raises(ConfigError) as info:
        resolve({}, {}, ConfigFile.parse(text, "config.toml"))
    assert str(info.value).startswith("config.toml:1: invalid value 4318 for otel_endpoint:")


def test_check_shows_it_without_credentials() -> None:
    config, sources = resolve({**NODE, "otel_endpoint": "https://u:secret@otel:4318"}, {})
    (row,) = [row for row in describe(config, sources) if row[0] == "otel-endpoint"]
    assert row == ("otel-endpoint", "https://***@otel:4318", "flag --otel-endpoint")
    assert "secret" not in repr(config)
