"""Tests of cli/settings/: the option table, precedence, the config file, errors."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest
import trustme

from trio_failover.cli.settings import (
    OPTIONS,
    ConfigFile,
    Option,
    Source,
    describe,
    expand_env,
    option,
    resolve,
)
from trio_failover.cli.settings.toml_file import key_lines as _key_lines
from trio_failover.cli.settings.toml_file import suggest_key
from trio_failover.core.config import Config
from trio_failover.core.errors import ConfigError, ConfigErrors

NODE = {"upstream": ["http://127.0.0.1:9001"]}
DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def toml(text: str, name: str = "config.toml") -> ConfigFile:
    return ConfigFile.parse(textwrap.dedent(text).lstrip("\n"), name)


# --- Precedence -----------------------------------------------------------------------------------

FILE_FIRST_BODY = """
[[upstream]]
url = "http://127.0.0.1:9001"

[timeouts]
first_body = "3s"
"""

# (flag, env, file?) -> (value, source). One option across all four sources.
PRECEDENCE: list[tuple[str | None, str | None, bool, float, str]] = [
    (None, None, False, 0.0, "default"),
    (None, None, True, 3.0, "file config.toml:5"),
    (None, "2s", False, 2.0, "env TRIO_FAILOVER_FIRST_BODY_TIMEOUT"),
    (None, "2s", True, 2.0, "env TRIO_FAILOVER_FIRST_BODY_TIMEOUT"),
    ("1s", None, False, 1.0, "flag --first-body-timeout"),
    ("1s", None, True, 1.0, "flag --first-body-timeout"),
    ("1s", "2s", False, 1.0, "flag --first-body-timeout"),
    ("1s", "2s", True, 1.0, "flag --first-body-timeout"),
]


@pytest.mark.parametrize(("flag", "env", "use_file", "seconds", "source"), PRECEDENCE)
def test_precedence(
    flag: str | None, env: str | None, use_file: bool, seconds: float, source: str
) -> None:
    flags: dict[str, object] = {"first_body_timeout": flag}
    environ = {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": env} if env is not None else {}
    file = toml(FILE_FIRST_BODY)
    if not use_file:
        flags.update(NODE)
    config, sources = resolve(flags, environ, file if use_file else None)
    assert config.first_body_timeout == seconds
    assert str(sources["first_body_timeout"]) == source


# An explicit 0 is a value like any other: it wins over a lower-precedence opt-in.
ZERO_OVERRIDES: list[tuple[str, dict[str, object], dict[str, str], str, str]] = [
    (
        "first_body_timeout",
        {"first_body_timeout": "0"},
        {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "5s"},
        'first_body = "7s"',
        "flag --first-body-timeout",
    ),
    (
        "first_body_timeout",
        {},
        {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "0"},
        'first_body = "7s"',
        "env TRIO_FAILOVER_FIRST_BODY_TIMEOUT",
    ),
    (
        "dead_peer_timeout",
        {"dead_peer_timeout": "0"},
        {"TRIO_FAILOVER_DEAD_PEER_TIMEOUT": "10s"},
        'dead_peer = "7s"',
        "flag --dead-peer-timeout",
    ),
    (
        "dead_peer_timeout",
        {},
        {"TRIO_FAILOVER_DEAD_PEER_TIMEOUT": "0"},
        'dead_peer = "7s"',
        "env TRIO_FAILOVER_DEAD_PEER_TIMEOUT",
    ),
    ("dead_peer_timeout", {}, {}, "dead_peer = 0", "file config.toml:5"),
]


@pytest.mark.parametrize(("field", "flags", "environ", "line", "source"), ZERO_OVERRIDES)
def test_explicit_zero_disables(
    field: str, flags: dict[str, object], environ: dict[str, str], line: str, source: str
) -> None:
    file = toml(f'[[upstream]]\nurl = "http://127.0.0.1:9001"\n\n[timeouts]\n{line}\n')
    config, sources = resolve(flags, environ, file)
    assert getattr(config, field) == 0.0
    assert str(sources[field]) == source


def test_defaults_match_config() -> None:
    config, sources = resolve(NODE, {})
    assert config == Config(upstreams=config.upstreams)
    assert all(str(sources[opt.field]) == "default" for opt in OPTIONS if opt.field is not None)
    assert str(sources["upstreams"]) == "flag --upstream"


# Every option parsed from text (flag and env take the same text).
TEXT_VALUES: list[tuple[str, str, object]] = [
    ("listen", "0.0.0.0:0", "0.0.0.0:0"),
    ("listen", "[::1]:8080", "[::1]:8080"),
    ("admin_listen", "off", None),
    ("admin_listen", "OFF", None),
    ("admin_listen", "127.0.0.1:9", "127.0.0.1:9"),
    ("connect_timeout", "300ms", 0.3),
    ("response_header_timeout", "1h30m", 5400.0),
    ("stream_idle_timeout", "0", 0.0),
    ("client_close", "rst-only", "rst-only"),
    ("max_attempts", "3", 3),
    ("affinity", "off", "off"),
    ("retry_status", "503, 429", frozenset({429, 503})),
    ("retry_status", "", frozenset()),
    ("retry_error_codes", "a,b", frozenset({"a", "b"})),
    ("retry_error_codes", "", frozenset()),
    ("max_request_body", "1MiB", 1024 * 1024),
    ("max_request_body", "1000", 1000),
    ("max_request_head", "8KiB", 8192),
    ("client_header_timeout", "5s", 5.0),
    ("keepalive_timeout", "0", 0.0),
    ("max_connections", "10", 10),
    ("shutdown_timeout", "1m", 60.0),
    ("pool_idle_timeout", "500ms", 0.5),
    ("log_format", "json", "json"),
    ("log_level", "DEBUG", "debug"),
    # The fleet's options (capacity and client keys: test_settings_fleet.py).
    ("balance", "least-loaded", "least-loaded"),
    ("balance", "priority", "priority"),
    ("queue_timeout", "5s", 5.0),
    ("queue_timeout", "0", 0.0),
    ("max_queue", "0", 0),
    ("max_queue", "20", 20),
    ("discovery_interval", "1m", 60.0),
    ("discovery_interval", "0", 0.0),
    ("unstreamed_timeout", "30m", 1800.0),
    ("admin_token", "s3cret-Token_1", "s3cret-Token_1"),
]


@pytest.mark.parametrize(("name", "text", "value"), TEXT_VALUES)
def test_text_values(name: str, text: str, value: object) -> None:
    config, _ = resolve({**NODE, name: text}, {})
    assert getattr(config, name) == value
    env = option(name).env
    config, sources = resolve(NODE, {env: text})
    assert getattr(config, name) == value
    assert str(sources[name]) == f"env {env}"


def test_every_config_field_has_an_option() -> None:
    fields = {field.name for field in attrs.fields(Config)}
    # pool_max_idle has no option yet (not in the issue); upstreams is
    # --upstream, clients is --api-key (both read by resolve() itself).
    assert fields - {"upstreams", "pool_max_idle", "clients"} == {
        opt.field for opt in OPTIONS if opt.field is not None
    }


def test_every_option_follows_the_naming_rule() -> None:
    for opt in OPTIONS:
        assert opt.flag == "--" + opt.name.replace("_", "-")
        if opt.name not in ("upstream", "api_key", "engine"):
            assert opt.env == "TRIO_FAILOVER_" + opt.flag[2:].upper().replace("-", "_")
    # The two lists take the plural.
    assert option("upstream").env == "TRIO_FAILOVER_UPSTREAMS"
    assert option("api_key").env == "TRIO_FAILOVER_API_KEYS"
    assert option("engine").env == "TRIO_FAILOVER_ENGINES"


# --- The config file ------------------------------------------------------------------------------

FULL_FILE = """
listen = "127.0.0.1:9080"
admin_listen = "off"
client_close = "ignore"
max_attempts = 2
affinity = "off"
retry_status = [503]
retry_error_codes = []
max_request_body = "1MiB"
max_request_head = 4096
max_connections = 5
log_format = "json"
log_level = "warning"

[timeouts]
connect = "1s"
response_header = "2s"
first_body = "3s"
stream_idle = 0
dead_peer = "4s"
client_header = "5s"
keepalive = "6s"
shutdown = "7s"
pool_idle = "8s"

[[upstream]]
name = "a"
url = "https://10.0.0.5:8443"
models = ["m1", "m2"]
headers = { Authorization = "Bearer ${KEY_A}", X-Plain = "p$" }
insecure_skip_verify = true

[[upstream]]
url = "http://10.0.0.6:8000/ollama"
models = { "m1" = "node-m1", "*" = "other" }

[upstream.headers]
X-Key = "${KEY_B}"
"""


def test_full_file() -> None:
    config, sources = resolve({}, {"KEY_A": "secret-a", "KEY_B": "secret-b"}, toml(FULL_FILE))
    assert config == Config(
        listen="127.0.0.1:9080",
        admin_listen=None,
        client_close="ignore",
        max_attempts=2,
        affinity="off",
        retry_status=frozenset({503}),
        retry_error_codes=frozenset(),
        max_request_body=1024 * 1024,
        max_request_head=4096,
        max_connections=5,
        log_format="json",
        log_level="warning",
        connect_timeout=1.0,
        response_header_timeout=2.0,
        first_body_timeout=3.0,
        stream_idle_timeout=0.0,
        dead_peer_timeout=4.0,
        client_header_timeout=5.0,
        keepalive_timeout=6.0,
        shutdown_timeout=7.0,
        pool_idle_timeout=8.0,
        upstreams=config.upstreams,
    )
    a, b = config.upstreams
    assert (a.name, a.url, a.insecure_skip_verify) == ("a", "https://10.0.0.5:8443", True)
    assert a.models == {"m1": "m1", "m2": "m2"}
    assert a.headers == {"Authorization": "Bearer secret-a", "X-Plain": "p$"}
    assert (b.name, b.base_path) == ("10.0.0.6:8000", "/ollama")
    assert b.models == {"m1": "node-m1", "*": "other"}
    assert b.model_name_for("m1") == "node-m1"
    assert b.model_name_for("anything") == "other"
    assert b.headers == {"X-Key": "secret-b"}
    assert str(sources["upstream:a"]) == "file config.toml:25"
    assert str(sources["upstream:10.0.0.6:8000"]) == "file config.toml:32"
    assert str(sources["keepalive_timeout"]) == "file config.toml:21"
    assert str(sources["log_level"]) == "file config.toml:12"


def test_docs_example_resolves(tmp_path: Path) -> None:
    """The complete example file of docs/configuration.md is valid and complete."""
    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    assert blocks, "docs/configuration.md has no ```toml block"
    example = max(blocks, key=len)
    pem = tmp_path / "file.pem"
    leaf = trustme.CA().issue_cert("127.0.0.1")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(pem))
    # The example's paths are illustrations; one file that loads as a CA, a
    # certificate and a key will do for all of them here.
    text = re.sub(r'"/[^"]+\.pem"', f'"{pem}"', example)
    environ = {"GPU_A_KEY": "k", "REMOTE_KEY": "r", "ALICE_KEY": "a", "CI_KEY": "c"}
    config, sources = resolve({}, environ, ConfigFile.parse(text))
    assert len(config.upstreams) >= 2
    assert any(node.headers for node in config.upstreams)
    assert any(node.models for node in config.upstreams)
    assert any(node.capacity for node in config.upstreams)
    assert config.clients
    for opt in OPTIONS:
        if opt.field and opt.toml:
            shown = sources[opt.field].kind == "file" or f"# {opt.toml[-1]} = " in example
            assert shown, f"the complete example lacks {opt.toml_key}"


def test_docs_check_sample_is_what_check_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/configuration.md's ``check`` table is the output for its complete example file."""
    from trio_failover.cli.cli import format_table

    docs = DOCS.read_text()
    example = max(re.findall(r"```toml\n(.*?)```", docs, re.DOTALL), key=len)
    # As the page says: saved as fleet.toml, the ca_file pointing to a real file.
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "fleet.toml").write_text(
        re.sub(r'ca_file = "[^"]+"', 'ca_file = "ca.pem"', example)
    )
    monkeypatch.chdir(tmp_path)
    environ = {"GPU_A_KEY": "k", "REMOTE_KEY": "r", "ALICE_KEY": "a", "CI_KEY": "c"}
    environ["TRIO_FAILOVER_LOG_LEVEL"] = "debug"
    flags = {"config": "fleet.toml", "listen": "127.0.0.1:9000", "capacity": ["2"]}
    config, sources = resolve(flags, environ)
    printed = format_table(describe(config, sources))
    sample = re.search(r"--capacity 2\n(option .*?)\n```", docs, re.DOTALL)
    assert sample is not None, "the check sample of docs/configuration.md"
    assert printed.rstrip() == sample.group(1).rstrip()


def _docs_table() -> dict[str, list[str]]:
    """The options table of the docs: flag -> its cells, backticks removed."""
    rows: dict[str, list[str]] = {}
    for line in DOCS.read_text().splitlines():
        match = re.match(r"\| `(--[a-z-]+)", line)
        if match:
            cells = [c.strip().strip("`") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[match.group(1)] = cells
    return rows


@pytest.mark.parametrize("opt", OPTIONS, ids=[opt.name for opt in OPTIONS])
def test_docs_describe_every_option(opt: Option) -> None:
    rows = _docs_table()
    assert opt.flag in rows, f"{opt.flag} missing from the docs' option table"
    _, env, key, default, meaning = rows[opt.flag]
    assert env == opt.env
    assert key == {"upstream": "[[upstream]]", "api_key": "[[client]]"}.get(opt.name, opt.toml_key)
    assert meaning
    if opt.default_note:
        assert default == opt.default_note
    elif opt.default is None:
        assert default == "none"
    else:
        assert opt.kind.from_text(default) == opt.default


# Which line wrote which key: tomllib keeps no positions, settings finds them.
KEY_LINES: list[tuple[str, tuple[str | int, ...], str]] = [
    ('listen = "x"\n', ("listen",), "c.toml:1"),
    ('# c\n\n  listen   =  "x"\n', ("listen",), "c.toml:3"),
    ('timeouts.connect = "1s"\n', ("timeouts", "connect"), "c.toml:1"),
    ('"listen" = "x"\n', ("listen",), "c.toml:1"),
    ("[timeouts]\nconnect = '1s'\n", ("timeouts", "connect"), "c.toml:2"),
    ("[timeouts]\nconnect = '1s'\n", ("timeouts", "first_body"), "c.toml:1"),
    ("[ timeouts ]\n\nconnect = '1s'\n", ("timeouts", "connect"), "c.toml:3"),
    ('[[upstream]]\nurl = "a"\n[[upstream]]\nurl = "b"\n', ("upstream", 1, "url"), "c.toml:4"),
    ('[[upstream]]\nurl = "a"\n[[upstream]]\nurl = "b"\n', ("upstream", 1), "c.toml:3"),
    ('[[upstream]]\nurl = "a"\n[[upstream]]\nurl = "b"\n', ("upstream", 0, "name"), "c.toml:1"),
    (
        '[[upstream]]\nurl = "a"\n[upstream.headers]\nX = "1"\n',
        ("upstream", 0, "headers", "X"),
        "c.toml:4",
    ),
    (
        '[[upstream]]\nheaders = { X = "1" }\n',
        ("upstream", 0, "headers", "X"),
        "c.toml:2",
    ),
    ('a = """\nlisten = "x"\n"""\nlisten = "y"\n', ("listen",), "c.toml:4"),
    ("a = '''\nlisten = 'x'\n'''\nlisten = 'y'\n", ("listen",), "c.toml:4"),
    ('a = """one line"""\nlisten = "y"\n', ("listen",), "c.toml:2"),
    ('listen = "x"\n', ("nothing",), "c.toml"),
    # Inline values over several lines: each element and key on its own line.
    (
        'client = [ { name = "a" },\n  { name = "b", bogus = 1 } ]\n',
        ("client", 1, "bogus"),
        "c.toml:2",
    ),
    (
        'client = [ { name = "a" },\n  { name = "b", bogus = 1 } ]\n',
        ("client", 0, "name"),
        "c.toml:1",
    ),
    ('upstream = [\n  { url = "a" },\n  { url = "b" },\n]\n', ("upstream", 1, "url"), "c.toml:3"),
    ('upstream = [\n  { url = "a" },\n  {\n    url = "b" },\n]\n', ("upstream", 1), "c.toml:3"),
    (
        'upstream = [\n  { url = "a" },\n  {\n    url = "b" },\n]\n',
        ("upstream", 1, "url"),
        "c.toml:4",
    ),
    (
        '[[upstream]]\nheaders = {\n  A = "1", B = "]" }\n'
        'models = [\n "x", # ]\n "y"]\nurl = "u"\n',
        ("upstream", 0, "url"),
        "c.toml:7",
    ),
    ('a = [\n"""\nlisten = 1\n""", 2]\nlisten = "y"\n', ("listen",), "c.toml:5"),
    ('a = [ [1,\n 2], [3,\n 4] ]\nlisten = "y"\n', ("a", 1, 1), "c.toml:3"),
]


@pytest.mark.parametrize(("text", "path", "where"), KEY_LINES)
def test_key_lines(text: str, path: tuple[str | int, ...], where: str) -> None:
    file = ConfigFile("c.toml", {}, _key_lines(text))
    assert file.where(*path) == where


def test_a_mistake_inside_a_multi_line_array_names_its_own_line() -> None:
    text = (
        'client = [ { name = "a", key = "k1" },\n'
        '  { name = "b", key = "k2", bogus = 1 } ]\n'
        "upstream = [\n"
        '  { name = "x", url = "http://127.0.0.1:1" },\n'
        '  { name = "y", url = "http://127.0.0.1:99999" },\n'
        "]\n"
    )
    with pytest.raises(ConfigErrors) as info:
        resolve({}, {}, ConfigFile.parse(text, "config.toml"))
    assert [(error.source, error.option) for error in info.value.errors] == [
        ("config.toml:2", "client.bogus"),
        ("config.toml:5", "upstream.url"),
    ]


def test_config_file_read(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('[[upstream]]\nurl = "http://127.0.0.1:1"\n\n[timeouts]\nconnect = "x"\n')
    with pytest.raises(ConfigError) as info:
        resolve({"config": str(path)}, {})
    assert info.value.source == f"{path}:5"
    assert info.value.option == "timeouts.connect"
    path.write_text('[[upstream]]\nurl = "http://127.0.0.1:1"\n')
    _, sources = resolve({}, {"TRIO_FAILOVER_CONFIG": str(path)})
    assert sources["config"] == Source("env", "TRIO_FAILOVER_CONFIG", str(path))
    assert str(sources["upstream:127.0.0.1:1"]) == f"file {path}:1"


# --- ${VAR} in header values ----------------------------------------------------------------------

EXPANSIONS: list[tuple[str, str]] = [
    ("plain", "plain"),
    ("Bearer ${KEY}", "Bearer k1"),
    ("${KEY}${OTHER}", "k1o2"),
    ("$KEY", "$KEY"),
    ("cost $5", "cost $5"),
    ("$", "$"),
]


@pytest.mark.parametrize(("template", "value"), EXPANSIONS)
def test_expand_env(template: str, value: str) -> None:
    assert expand_env(template, {"KEY": "k1", "OTHER": "o2", "EMPTY": ""}) == value


EXPANSION_REJECTS: list[tuple[str, str]] = [
    ("${MISSING}", "environment variable MISSING is not set"),
    ("${EMPTY}", "environment variable EMPTY is empty"),
    ("Bearer ${EMPTY}", "environment variable EMPTY is empty"),
    ("Bearer ${KEY} ${MISSING}", "MISSING is not set"),
    ("${}", "not a valid variable reference"),
    ("${1X}", "not a valid variable reference"),
    ("${KEY", "not closed"),
    ("${KEY} ${", "not closed"),
]


@pytest.mark.parametrize(("template", "message"), EXPANSION_REJECTS)
def test_expand_env_rejects(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        expand_env(template, {"KEY": "k1", "EMPTY": ""})


# --- Bad values -----------------------------------------------------------------------------------

N = '[[upstream]]\nurl = "http://127.0.0.1:9001"\n'

# flags, environ, file text (None: no file) -> source, option, value, expected (substring)
BAD: list[tuple[str, dict[str, Any], dict[str, str], str | None, str, str, object, str]] = [
    (
        "duration without unit, flag",
        {**NODE, "first_body_timeout": "5"},
        {},
        None,
        "--first-body-timeout",
        "first-body-timeout",
        "5",
        "needs a unit",
    ),
    (
        "duration without unit, env",
        NODE,
        {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "5"},
        None,
        "TRIO_FAILOVER_FIRST_BODY_TIMEOUT",
        "first-body-timeout",
        "5",
        "needs a unit",
    ),
    (
        "duration without unit, file",
        {},
        {},
        N + '[timeouts]\nconnect = "10s"\nfirst_body = "5"\n',
        "config.toml:5",
        "timeouts.first_body",
        "5",
        "needs a unit",
    ),
    (
        "duration as a bare TOML number",
        {},
        {},
        N + "[timeouts]\nfirst_body = 5\n",
        "config.toml:4",
        "timeouts.first_body",
        5,
        "only 0 may be a bare number",
    ),
    (
        "negative duration, flag",
        {**NODE, "stream_idle_timeout": "-1s"},
        {},
        None,
        "--stream-idle-timeout",
        "stream-idle-timeout",
        "-1s",
        "must not be negative",
    ),
    (
        "negative duration, file",
        {},
        {},
        N + '[timeouts]\ndead_peer = "-30s"\n',
        "config.toml:4",
        "timeouts.dead_peer",
        "-30s",
        "must not be negative",
    ),
    (
        "zero where a positive duration is needed (Config's validator, relabelled)",
        NODE,
        {"TRIO_FAILOVER_CONNECT_TIMEOUT": "0"},
        None,
        "TRIO_FAILOVER_CONNECT_TIMEOUT",
        "connect-timeout",
        "0",
        "greater than zero",
    ),
    (
        "zero connections in the file (Config's validator, relabelled)",
        {},
        {},
        "max_connections = 0\n" + N,
        "config.toml:1",
        "max_connections",
        0,
        "greater than zero",
    ),
    (
        "negative attempts",
        {**NODE, "max_attempts": "-1"},
        {},
        None,
        "--max-attempts",
        "max-attempts",
        "-1",
        "must not be negative",
    ),
    (
        "not a number",
        {**NODE, "max_connections": "many"},
        {},
        None,
        "--max-connections",
        "max-connections",
        "many",
        "whole number",
    ),
    (
        "whole number with underscores",
        {**NODE, "max_queue": "1_000"},
        {},
        None,
        "--max-queue",
        "max-queue",
        "1_000",
        "whole number",
    ),
    (
        "whole number with a plus sign",
        {**NODE, "max_attempts": "+5"},
        {},
        None,
        "--max-attempts",
        "max-attempts",
        "+5",
        "whole number",
    ),
    (
        "whole number in Arabic-Indic digits",
        {**NODE, "max_connections": "٣"},
        {},
        None,
        "--max-connections",
        "max-connections",
        "٣",
        "whole number",
    ),
    (
        "whole number in full-width digits",
        {**NODE, "workers": "\uff12"},
        {},
        None,
        "--workers",
        "workers",
        "\uff12",
        "whole number",
    ),
    (
        "a node header value that is not a string",
        {},
        {},
        '[[upstream]]\nurl = "http://127.0.0.1:9001"\nheaders = { A = 1 }\n',
        "config.toml:3",
        "upstream.headers.A",
        1,
        "must be a string",
    ),
    (
        "unknown choice, flag",
        {**NODE, "client_close": "close"},
        {},
        None,
        "--client-close",
        "client-close",
        "close",
        "one of abort, rst-only, ignore",
    ),
    (
        "unknown choice, env",
        NODE,
        {"TRIO_FAILOVER_AFFINITY": "sticky"},
        None,
        "TRIO_FAILOVER_AFFINITY",
        "affinity",
        "sticky",
        "one of off, prefix",
    ),
    (
        "unknown choice, file",
        {},
        {},
        'log_format = "xml"\n' + N,
        "config.toml:1",
        "log_format",
        "xml",
        "one of text, json",
    ),
    (
        "bad size",
        {**NODE, "max_request_body": "32M"},
        {},
        None,
        "--max-request-body",
        "max-request-body",
        "32M",
        "unknown size unit",
    ),
    (
        "bad status",
        NODE,
        {"TRIO_FAILOVER_RETRY_STATUS": "429,5xx"},
        None,
        "TRIO_FAILOVER_RETRY_STATUS",
        "retry-status",
        "429,5xx",
        "'5xx' is not an HTTP status code",
    ),
    (
        "a success status is no retry status, flag",
        {**NODE, "retry_status": "503,200"},
        {},
        None,
        "--retry-status",
        "retry-status",
        "503,200",
        "200 is outside 400-599: only error statuses fail over",
    ),
    (
        "a 3xx is no retry status, file",
        {},
        {},
        "retry_status = [399]\n" + N,
        "config.toml:1",
        "retry_status",
        [399],
        "399 is outside 400-599",
    ),
    (
        "status out of range, file",
        {},
        {},
        "retry_status = [429, 600]\n" + N,
        "config.toml:1",
        "retry_status",
        [429, 600],
        "600 is outside 400-599",
    ),
    (
        "bad listen address",
        {**NODE, "listen": "8080"},
        {},
        None,
        "--listen",
        "listen",
        "8080",
        "HOST:PORT",
    ),
    (
        "wrong TOML type",
        {},
        {},
        "listen = 8080\n" + N,
        "config.toml:1",
        "listen",
        8080,
        "expected a string",
    ),
    (
        "bad URL, flag",
        {"upstream": ["a=ftp://10.0.0.5"]},
        {},
        None,
        "--upstream",
        "upstream",
        "a=ftp://10.0.0.5",
        "http:// or https://",
    ),
    (
        "bad URL, env",
        {},
        {"TRIO_FAILOVER_UPSTREAMS": "http://127.0.0.1:1,10.0.0.5:8000"},
        None,
        "TRIO_FAILOVER_UPSTREAMS",
        "upstream",
        "10.0.0.5:8000",
        "http://",
    ),
    (
        "bad URL, file",
        {},
        {},
        N + '[[upstream]]\nname = "b"\nurl = "http://10.0.0.6:port"\n',
        "config.toml:5",
        "upstream.url",
        "http://10.0.0.6:port",
        "port",
    ),
    (
        "URL with a blank in its path, file",
        {},
        {},
        N + '[[upstream]]\nname = "b"\nurl = "http://10.0.0.6:1/my models"\n',
        "config.toml:5",
        "upstream.url",
        "http://10.0.0.6:1/my models",
        "percent-encode",
    ),
    (
        "URL missing, file",
        {},
        {},
        N + '[[upstream]]\nname = "b"\n',
        "config.toml:3",
        "upstream.url",
        "",
        "needs a url",
    ),
    (
        "bad node name",
        {},
        {},
        '[[upstream]]\nname = "gpu a"\nurl = "http://10.0.0.6:1"\n',
        "config.toml:2",
        "upstream.name",
        "gpu a",
        "token characters",
    ),
    (
        "duplicate node names, flag",
        {"upstream": ["a=http://10.0.0.5:1", "a=http://10.0.0.6:1"]},
        {},
        None,
        "--upstream",
        "upstream",
        "a",
        "unique",
    ),
    (
        "duplicate node names, file",
        {},
        {},
        '[[upstream]]\nname = "a"\nurl = "http://h:1"\n\n'
        '[[upstream]]\nname = "a"\nurl = "http://h:2"\n',
        "config.toml:5",
        "upstream.name",
        "a",
        "also at config.toml:1",
    ),
    (
        "duplicate default names",
        {},
        {"TRIO_FAILOVER_UPSTREAMS": "http://h:1, http://h:1/v1"},
        None,
        "TRIO_FAILOVER_UPSTREAMS",
        "upstream",
        "h:1",
        "unique",
    ),
    (
        "no upstream at all",
        {},
        {},
        None,
        "--upstream",
        "upstream",
        "",
        "at least one node",
    ),
    (
        "no upstream in the file",
        {},
        {},
        'listen = "127.0.0.1:1"\n',
        "config.toml",
        "upstream",
        "",
        "at least one node",
    ),
    (
        "empty upstream list in env",
        {},
        {"TRIO_FAILOVER_UPSTREAMS": " , "},
        N,
        "TRIO_FAILOVER_UPSTREAMS",
        "upstream",
        " , ",
        "at least one node",
    ),
    (
        "unknown top-level key",
        {},
        {},
        'listne = "127.0.0.1:1"\n' + N,
        "config.toml:1",
        "listne",
        "listne",
        "unknown key at the top level (did you mean listen?",
    ),
    (
        "unknown key in [timeouts]",
        {},
        {},
        N + '\n[timeouts]\nconnect = "1s"\nfirst_byte = "1s"\n',
        "config.toml:6",
        "timeouts.first_byte",
        "first_byte",
        "unknown key in [timeouts] (did you mean first_body?",
    ),
    (
        "unknown key in [[upstream]]",
        {},
        {},
        N + '[[upstream]]\nurl = "http://h:2"\nheader = { A = "secret" }\n',
        "config.toml:5",
        "upstream.header",
        "header",
        "unknown key in [[upstream]] (did you mean headers?",
    ),
    (
        "[timeouts] header is a header timeout, not dead_peer",
        {},
        {},
        N + '[timeouts]\nheader = "5s"\n',
        "config.toml:4",
        "timeouts.header",
        "header",
        "unknown key in [timeouts] (did you mean response_header?)",
    ),
    (
        "[timeouts] with the flag's _timeout ending",
        {},
        {},
        N + '[timeouts]\nresponse_header_timeout = "5s"\n',
        "config.toml:4",
        "timeouts.response_header_timeout",
        "response_header_timeout",
        "unknown key in [timeouts] (did you mean response_header?)",
    ),
    (
        "a timeout at the top level points into [timeouts]",
        {},
        {},
        'response_header_timeout = "5s"\n' + N,
        "config.toml:1",
        "response_header_timeout",
        "response_header_timeout",
        "unknown key at the top level (did you mean response_header in [timeouts]?)",
    ),
    (
        "[[upstreams]] has its line",
        {},
        {},
        N + '[[upstreams]]\nurl = "http://h:2"\n',
        "config.toml:3",
        "upstreams",
        "upstreams",
        "unknown key at the top level (did you mean [[upstream]]?)",
    ),
    (
        "a number in quotes",
        {},
        {},
        'max_queue = "10"\n' + N,
        "config.toml:1",
        "max_queue",
        "10",
        'max_queue = "10" is a string; write it as a number: max_queue = 10',
    ),
    (
        "a node's capacity in quotes",
        {},
        {},
        N + 'capacity = "2"\n',
        "config.toml:3",
        "upstream.capacity",
        "2",
        'capacity = "2" is a string; write it as a number: capacity = 2',
    ),
    (
        "unknown subtable",
        {},
        {},
        N + "[limits]\nmax = 1\n",
        "config.toml:3",
        "limits",
        "limits",
        "unknown key at the top level",
    ),
    (
        "timeouts is not a table",
        {},
        {},
        'timeouts = "1s"\n' + N,
        "config.toml:1",
        "timeouts",
        "1s",
        "[timeouts] table",
    ),
    (
        "TOML syntax error",
        {},
        {},
        N + "\n[timeouts]\nconnect = 10s\n",
        "config.toml:5",
        "config",
        "config.toml",
        "not valid TOML",
    ),
    (
        "TOML error at the end",
        {},
        {},
        N + "retry_status = [429,\n",
        "config.toml:3",
        "config",
        "config.toml",
        "not valid TOML",
    ),
    (
        "duplicate TOML key",
        {},
        {},
        N + 'listen = "a:1"\nlisten = "b:1"\n',
        "config.toml:4",
        "config",
        "config.toml",
        "not valid TOML",
    ),
    (
        "undefined variable in a header",
        {},
        {},
        '[[upstream]]\nurl = "http://h:1"\nheaders = { Authorization = "Bearer ${GPU_KEY}" }\n',
        "config.toml:3",
        "upstream.headers.Authorization",
        "${GPU_KEY}",
        "environment variable GPU_KEY is not set; node h:1 needs it for its Authorization header",
    ),
    (
        "empty variable in a header, named node",
        {},
        {"GPU_KEY": ""},
        '[[upstream]]\nname = "gpu-a"\nurl = "http://h:1"\n'
        'headers = { Authorization = "Bearer ${GPU_KEY}" }\n',
        "config.toml:4",
        "upstream.headers.Authorization",
        "${GPU_KEY}",
        "environment variable GPU_KEY is empty; node gpu-a needs it for its Authorization header",
    ),
    (
        "bad header name",
        {},
        {},
        '[[upstream]]\nurl = "http://h:1"\n[upstream.headers]\n"X Key" = "v"\n',
        "config.toml:4",
        "upstream.headers.X Key",
        "X Key",
        "not a valid header name",
    ),
    (
        "header value with a newline",
        {},
        {"V": "a\r\nInjected: 1"},
        '[[upstream]]\nurl = "http://h:1"\nheaders = { X = "${V}" }\n',
        "config.toml:3",
        "upstream.headers.X",
        "X",
        "must not contain CR, LF or NUL",
    ),
    (
        "empty models list",
        {},
        {},
        '[[upstream]]\nurl = "http://h:1"\nmodels = []\n',
        "config.toml:3",
        "upstream.models",
        [],
        "non-empty list",
    ),
    (
        "models of the wrong type",
        {},
        {},
        '[[upstream]]\nurl = "http://h:1"\nmodels = 3\n',
        "config.toml:3",
        "upstream.models",
        3,
        "a list or a table",
    ),
    (
        "insecure_skip_verify not a bool",
        {},
        {},
        '[[upstream]]\nurl = "https://h:1"\ninsecure_skip_verify = "yes"\n',
        "config.toml:3",
        "upstream.insecure_skip_verify",
        "yes",
        "true or false",
    ),
    (
        "ca_file missing",
        {},
        {},
        '[[upstream]]\nurl = "https://h:1"\nca_file = "/nonexistent/ca.pem"\n',
        "config.toml:3",
        "upstream.ca_file",
        "/nonexistent/ca.pem",
        "no such file",
    ),
    (
        "TLS certificate file missing",
        {**NODE, "tls_cert": "/nonexistent/cert.pem"},
        {},
        None,
        "--tls-cert",
        "tls-cert",
        "/nonexistent/cert.pem",
        "no such file",
    ),
    (
        "a bad value is an error even when a flag overrides it",
        {**NODE, "first_body_timeout": "1s"},
        {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "1"},
        None,
        "TRIO_FAILOVER_FIRST_BODY_TIMEOUT",
        "first-body-timeout",
        "1",
        "needs a unit",
    ),
]


@pytest.mark.parametrize(
    ("flags", "environ", "text", "source", "option_", "value", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD],
)
def test_bad_values(
    flags: dict[str, Any],
    environ: dict[str, str],
    text: str | None,
    source: str,
    option_: str,
    value: object,
    expected: str,
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(flags, environ, None if text is None else ConfigFile.parse(text, "config.toml"))
    error = info.value
    assert (error.source, error.option, error.value) == (source, option_, value)
    assert expected in error.expected
    message = str(error)
    assert "\n" not in message
    assert message.startswith(f"{source}: ")
    assert repr(value) in message


TIMEOUT_KEYS = tuple(opt.toml[1] for opt in OPTIONS if opt.toml and opt.toml[0] == "timeouts")
TOP_KEYS = (*(opt.toml[0] for opt in OPTIONS if opt.toml and len(opt.toml) == 1), "timeouts")


@pytest.mark.parametrize(
    ("key", "top_level", "hint"),
    [
        # The words of the key before its letters: "header" is in response_header.
        ("header", False, "response_header"),
        ("header_timeout", False, "response_header"),
        ("response_header_timeout", False, "response_header"),
        ("response-header", False, "response_header"),
        ("Connect_Timeout", False, "connect"),
        ("idle", False, "stream_idle"),
        ("first_byte", False, "first_body"),  # by its letters
        ("queu", False, "queue"),
        ("keep_alive", False, "keepalive"),
        ("xyz", False, None),
        # At the top level, a timeout's name points into [timeouts] ...
        ("response_header_timeout", True, "response_header in [timeouts]"),
        ("stream-idle-timeout", True, "stream_idle in [timeouts]"),
        ("connect", True, "connect in [timeouts]"),
        ("shutdown_timeout", True, "shutdown in [timeouts]"),
        # ... and so does a misspelt one, closer to a timeout than to any top-level key.
        ("respone_header", True, "response_header in [timeouts]"),
        ("stream_idel", True, "stream_idle in [timeouts]"),
        ("header", True, "client_header"),  # a top-level key, closer than [timeouts]'s
        ("response_heder", True, "response_header in [timeouts]"),
        ("lsten", True, "listen"),
        ("limits", True, None),
        # ... and the tables are named as they are written.
        ("timeout", True, "[timeouts]"),
        ("upstreams", True, "[[upstream]]"),
        ("clients", True, "[[client]]"),
        ("listne", True, "listen"),
        ("admin-listen", True, "admin_listen"),
        ("max_queue_size", True, "max_queue"),
    ],
)
def test_the_suggestion_for_an_unknown_key(key: str, top_level: bool, hint: str | None) -> None:
    known = TOP_KEYS if top_level else TIMEOUT_KEYS
    assert suggest_key(key, known, top_level=top_level) == hint


def test_mistakes_of_a_file_come_in_line_order_the_whole_file_last() -> None:
    text = 'listne = "x"\n\n[[upstreams]]\nurl = "http://h:2"\n\n[timeouts]\nheader = "5s"\n'
    with pytest.raises(ConfigErrors) as info:
        resolve({"max_queue": "lots"}, {}, ConfigFile.parse(text, "config.toml"))
    assert [(error.source, error.option) for error in info.value.errors] == [
        ("--max-queue", "max-queue"),
        ("config.toml:1", "listne"),
        ("config.toml:3", "upstreams"),
        ("config.toml:7", "timeouts.header"),
        ("config.toml", "upstream"),  # no node: the file as a whole, after its lines
    ]


def test_unknown_flag_names_are_a_bug() -> None:
    with pytest.raises(TypeError, match="first_body"):
        resolve({**NODE, "first_body": "1s"}, {})


def test_tls_needs_both(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    with pytest.raises(ConfigError, match="give --tls-key as well") as info:
        resolve({**NODE, "tls_cert": str(cert)}, {})
    assert info.value.source == "--tls-cert"
    config, _ = resolve({**NODE, "tls_cert": str(cert)}, {"TRIO_FAILOVER_TLS_KEY": str(cert)})
    assert (config.tls_cert, config.tls_key) == (str(cert), str(cert))


@pytest.mark.parametrize(
    ("given", "environ", "text", "source", "option_"),
    [
        ({"tls_cert": "JUNK", "tls_key": "JUNK"}, {}, None, "--tls-cert", "tls-cert"),
        (
            {"tls_key": "JUNK"},
            {"TRIO_FAILOVER_TLS_CERT": "JUNK"},
            None,
            "TRIO_FAILOVER_TLS_CERT",
            "tls-cert",
        ),
        ({}, {}, 'tls_cert = "JUNK"\ntls_key = "JUNK"\n', "config.toml:1", "tls_cert"),
    ],
)
def test_a_tls_pair_that_cannot_be_loaded_names_its_source(
    tmp_path: Path,
    given: dict[str, str],
    environ: dict[str, str],
    text: str | None,
    source: str,
    option_: str,
) -> None:
    # check refuses what serving would refuse, naming where the certificate was set.
    junk = tmp_path / "junk.pem"
    junk.write_text("junk")
    flags = {**NODE, **{name: str(junk) for name in given}}
    environ = {name: str(junk) for name in environ}
    file = (
        None if text is None else ConfigFile.parse(text.replace("JUNK", str(junk)), "config.toml")
    )
    with pytest.raises(ConfigError) as info:
        resolve(flags, environ, file)
    assert (info.value.source, info.value.option, info.value.value) == (source, option_, str(junk))
    assert "cannot load the certificate and key" in str(info.value)


def test_an_unloadable_ca_file_of_an_https_node_names_its_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("junk")
    text = f'[[upstream]]\nurl = "http://h:1"\nca_file = "{junk}"\n\n'
    text += f'[[upstream]]\nurl = "https://h:2"\nca_file = "{junk}"\n'
    with pytest.raises(ConfigError) as info:
        resolve({}, {}, ConfigFile.parse(text, "config.toml"))
    # The http:// node's is ignored when serving (with a warning), so here too.
    error = info.value
    assert (error.source, error.option, error.value) == (
        "config.toml:7",
        "upstream.ca_file",
        str(junk),
    )
    assert "cannot load CA certificates" in error.expected


def test_missing_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot read it") as info:
        resolve({}, {"TRIO_FAILOVER_CONFIG": missing})
    assert (info.value.source, info.value.value) == ("TRIO_FAILOVER_CONFIG", missing)


def test_secrets_never_in_errors() -> None:
    text = '[[upstream]]\nurl = "http://h:1"\nheaders = { A = "sk-123 ${NOPE}" }\n'
    with pytest.raises(ConfigError) as info:
        resolve({}, {}, ConfigFile.parse(text))
    assert "sk-123" not in str(info.value)


@pytest.mark.parametrize(
    ("flags", "environ", "url"),
    [
        ({"upstream": ["http://u:pw@h:99999"]}, {}, "http://***@h:99999"),
        ({"upstream": ["a=ftp://u:pw@h"]}, {}, "a=ftp://***@h"),
        ({**NODE, "otel_endpoint": "http://u:pw@h:99999"}, {}, "http://***@h:99999"),
        (NODE, {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://u:pw@h"}, "grpc://***@h"),
    ],
)
def test_url_passwords_are_masked_in_errors(
    flags: dict[str, Any], environ: dict[str, str], url: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(flags, environ)
    assert "pw" not in str(info.value)
    assert repr(url) in str(info.value)


# --- describe(): what `check` prints --------------------------------------------------------------


def test_describe_masks_secrets_and_names_sources() -> None:
    file = toml(
        """
        [[upstream]]
        name = "a"
        url = "http://user:pw@10.0.0.5:8000"
        models = { "m" = "node-m", "*" = "x" }
        headers = { Authorization = "Bearer ${KEY}", X-Other = "plain-secret" }
        """
    )
    config, sources = resolve(
        {"listen": "127.0.0.1:1"}, {"KEY": "sk-live", "TRIO_FAILOVER_LOG_LEVEL": "debug"}, file
    )
    rows = {row[0]: row[1:] for row in describe(config, sources)}
    text = repr(rows)
    for secret in ("sk-live", "plain-secret", "pw"):
        assert secret not in text
    assert rows["upstream a"] == (
        "http://***@10.0.0.5:8000 models=m->node-m,*->x headers=Authorization:***,X-Other:***",
        "file config.toml:1",
    )
    assert rows["listen"] == ("127.0.0.1:1", "flag --listen")
    assert rows["log-level"] == ("debug", "env TRIO_FAILOVER_LOG_LEVEL")
    assert rows["connect-timeout"] == ("10s", "default")
    assert rows["config"] == ("config.toml", "file config.toml")
    labels = [opt.label for opt in OPTIONS]
    capacity, engine = labels.index("capacity"), labels.index("engine")
    assert list(rows) == [
        "config",
        "listen",
        "admin-listen",
        "upstream a",
        *labels[4:capacity],
        "capacity a",
        *labels[capacity + 1 : engine],
        "engine a",
        *labels[engine + 1 :],
    ]
    assert rows["capacity a"] == ("auto", "default")
    assert rows["engine a"] == ("auto", "default")
    assert rows["api-key"] == ("none", "default")
    assert rows["admin-token"] == ("none", "default")
