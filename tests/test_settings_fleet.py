"""Tests of the settings for fleets: capacity, the queue, discovery, client keys, the admin token.

Also the checks of issue 21: retry statuses, port ranges, ``${VAR}`` in
headers and keys, and every mistake of a config reported at once.
"""

from __future__ import annotations

import itertools
import pickle
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_failover.cli.settings import ConfigFile, describe, resolve
from trio_failover.core.config import ClientKey, Config, Upstream
from trio_failover.core.errors import ConfigError, ConfigErrors

NODE = {"upstream": ["http://127.0.0.1:9001"]}
URL = "http://127.0.0.1:9001"


def toml(text: str) -> ConfigFile:
    return ConfigFile.parse(textwrap.dedent(text).lstrip("\n"), "config.toml")


# --- Library defaults -----------------------------------------------------------------------------


def test_library_config_gets_every_spec_default() -> None:
    config = Config(upstreams=[Upstream("a", URL)])
    assert config.balance == "priority"
    assert config.queue_timeout == 120.0
    assert config.max_queue == 1000
    assert config.discovery_interval == 30.0
    assert config.unstreamed_timeout == 600.0
    assert config.clients == ()
    assert config.admin_token is None
    assert config.upstreams[0].capacity is None  # auto
    assert config.upstreams[0].engine == "auto"
    assert (config.load_interval, config.cold_start_timeout) == (2.0, 300.0)
    assert Upstream("a", URL, capacity=2).capacity == 2


def test_config_with_secrets_survives_pickle() -> None:
    """``serve`` hands the Config to its new process image as a pickle (reexec.py)."""
    config = Config(
        upstreams=[Upstream("a", URL, capacity=3)],
        clients=[ClientKey("alice", "sk-alice")],
        admin_token="tok-123",
    )
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"balance": "random"}, "one of priority, least-loaded"),
        ({"queue_timeout": -1.0}, "must not be negative"),
        ({"max_queue": -1}, "must not be negative"),
        ({"discovery_interval": -1.0}, "must not be negative"),
        ({"unstreamed_timeout": 0.0}, "greater than zero"),
        ({"retry_status": {200}}, "400-599"),
        ({"retry_status": {600}}, "400-599"),
        ({"admin_token": ""}, "visible ASCII"),
        ({"clients": [ClientKey("a", "k1"), ClientKey("a", "k2")]}, "unique"),
        ({"clients": [ClientKey("a", "k1"), ClientKey("b", "k1")]}, "same key as client a"),
    ],
)
def test_config_validators(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        Config(upstreams=[Upstream("a", URL)], **kwargs)
    assert "k1" not in str(info.value)


@pytest.mark.parametrize("capacity", [-1, True, 1.5, "2"])
def test_upstream_capacity_must_be_a_whole_number(capacity: Any) -> None:
    with pytest.raises(ConfigError, match="whole number"):
        Upstream("a", URL, capacity=capacity)


def _only_mistake(flags: dict[str, Any], environ: dict[str, str], text: str | None) -> ConfigError:
    """The one ``ConfigError`` (not a ``ConfigErrors`` of several) that ``resolve`` raises."""
    with pytest.raises(ConfigError) as info:
        resolve(flags, environ, None if text is None else ConfigFile.parse(text))
    got = info.value
    assert not isinstance(got, ConfigErrors), str(got)
    return got


def _assert_mistake(got: ConfigError, error: tuple[str, str, object, str]) -> None:
    source, option_, value, expected = error
    assert (got.source, got.option, got.value) == (source, option_, value)
    assert expected in got.expected


# --- Capacity: precedence -------------------------------------------------------------------------

# The six places a capacity for node "a" may come from, most binding first
# (docs/configuration.md#capacity), each with its own value so the winner is visible.
TIERS = ("flag NAME=N", "env NAME=N", "node in file", "bare flag", "bare env", "top-level file")
TIER_SOURCES = (
    "flag --capacity",
    "env TRIO_FAILOVER_CAPACITY",
    "file config.toml:6",
    "flag --capacity",
    "env TRIO_FAILOVER_CAPACITY",
    "file config.toml:1",
)


def _capacity_inputs(tiers: set[int]) -> tuple[dict[str, object], dict[str, str], ConfigFile]:
    flag = [item for tier, item in ((0, "a=1"), (3, "4")) if tier in tiers]
    env = ",".join(item for tier, item in ((1, "a=2"), (4, "5")) if tier in tiers)
    text = ("capacity = 6\n" if 5 in tiers else "# none\n") + (
        '\n[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9001"\n'
        + ("capacity = 3\n" if 2 in tiers else "\n")
        + '\n[[upstream]]\nname = "b"\nurl = "http://127.0.0.1:9002"\n'
    )
    flags: dict[str, object] = {"capacity": flag} if flag else {}
    environ = {"TRIO_FAILOVER_CAPACITY": env} if env else {}
    return flags, environ, ConfigFile.parse(text, "config.toml")


ALL_SUBSETS = [
    set(subset) for size in range(7) for subset in itertools.combinations(range(6), size)
]


@pytest.mark.parametrize(
    "tiers", ALL_SUBSETS, ids=["+".join(TIERS[t] for t in sorted(s)) or "none" for s in ALL_SUBSETS]
)
def test_capacity_precedence_every_combination(tiers: set[int]) -> None:
    """For every combination of the six sources, the first one that is set wins."""
    flags, environ, file = _capacity_inputs(tiers)
    config, sources = resolve(flags, environ, file)
    a, b = config.upstreams
    if tiers:
        winner = min(tiers)
        assert (a.capacity, str(sources["capacity:a"])) == (winner + 1, TIER_SOURCES[winner])
    else:
        assert (a.capacity, str(sources["capacity:a"])) == (None, "default")  # auto
    # Node b has no value of its own: only the bare values and the top level reach it.
    rest = sorted(tiers & {3, 4, 5})
    if rest:
        assert (b.capacity, str(sources["capacity:b"])) == (rest[0] + 1, TIER_SOURCES[rest[0]])
    else:
        assert (b.capacity, str(sources["capacity:b"])) == (None, "default")


# The cases the docs spell out, by name.
NAMED_CASES: list[tuple[str, dict[str, object], dict[str, str], str, dict[str, int | None]]] = [
    ("nothing anywhere", {}, {}, "", {"a": None, "b": None}),
    ("auto undoes a bare flag", {"capacity": ["4", "a=auto"]}, {}, "", {"a": None, "b": 4}),
    ("bare auto flag beats the file", {"capacity": ["auto"]}, {}, "top6", {"a": None, "b": None}),
    ("node in file beats bare auto", {"capacity": ["auto"]}, {}, "a3", {"a": 3, "b": None}),
    ("bare flag for all", {"capacity": ["2"]}, {}, "", {"a": 2, "b": 2}),
    ("flag list with a name", {"capacity": ["2,a=4"]}, {}, "", {"a": 4, "b": 2}),
    ("flag repeated", {"capacity": ["2", "a=4"]}, {}, "", {"a": 4, "b": 2}),
    ("env list", {}, {"TRIO_FAILOVER_CAPACITY": "b=7, 1"}, "", {"a": 1, "b": 7}),
    (
        "bare flag beats bare env",
        {"capacity": ["2"]},
        {"TRIO_FAILOVER_CAPACITY": "5"},
        "",
        {"a": 2, "b": 2},
    ),
    (
        "named env beats bare flag",
        {"capacity": ["2"]},
        {"TRIO_FAILOVER_CAPACITY": "a=5"},
        "",
        {"a": 5, "b": 2},
    ),
    ("node in file beats bare flag", {"capacity": ["2"]}, {}, "a3", {"a": 3, "b": 2}),
    ("named flag beats node in file", {"capacity": ["a=9"]}, {}, "a3", {"a": 9, "b": None}),
    ("top level for the rest", {}, {}, "a3 top6", {"a": 3, "b": 6}),
    ("bare env beats top level", {}, {"TRIO_FAILOVER_CAPACITY": "5"}, "top6", {"a": 5, "b": 5}),
    ("zero is a value", {"capacity": ["a=0"]}, {}, "a3 top6", {"a": 0, "b": 6}),
]


@pytest.mark.parametrize(
    ("flags", "environ", "file_parts", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in NAMED_CASES],
)
def test_capacity_named_cases(
    flags: dict[str, object],
    environ: dict[str, str],
    file_parts: str,
    expected: dict[str, int | None],
) -> None:
    text = ("capacity = 6\n" if "top6" in file_parts else "") + (
        '[[upstream]]\nname = "a"\nurl = "http://h:1"\n'
        + ("capacity = 3\n" if "a3" in file_parts else "")
        + '[[upstream]]\nname = "b"\nurl = "http://h:2"\n'
    )
    config, _ = resolve(flags, environ, ConfigFile.parse(text))
    assert {node.name: node.capacity for node in config.upstreams} == expected


def test_node_capacity_in_file_applies_only_to_the_file_nodes() -> None:
    """With --upstream in force, the file's tables (and their capacities) are not used."""
    file = toml(
        """
        capacity = 2
        [[upstream]]
        name = "a"
        url = "http://h:1"
        capacity = 9
        """
    )
    config, sources = resolve({"upstream": ["a=http://h:3"]}, {}, file)
    assert config.upstreams[0].capacity == 2
    assert str(sources["capacity:a"]) == "file config.toml:1"


def test_capacity_shown_by_check() -> None:
    config, sources = resolve(
        {"upstream": ["a=http://h:1", "b=http://h:2"], "capacity": ["a=4"]}, {}
    )
    rows = {row[0]: row[1:] for row in describe(config, sources)}
    assert rows["capacity a"] == ("4", "flag --capacity")
    assert rows["capacity b"] == ("auto", "default")
    assert "capacity" not in rows


# --- Capacity: mistakes ---------------------------------------------------------------------------

TWO = {"upstream": ["a=http://h:1", "b=http://h:2"]}

# flags, environ, file text -> (source, option, value, expected)
Mistake = tuple[str, dict[str, Any], dict[str, str], str | None, tuple[str, str, object, str]]


def _capacity_flag(case: str, value: str, expected: str = "expected N, auto, NAME=N") -> Mistake:
    """A bad ``--capacity`` for the two nodes of ``TWO``, reported as given."""
    return (
        case,
        {**TWO, "capacity": [value]},
        {},
        None,
        ("--capacity", "capacity", value, expected),
    )


CAPACITY_BAD: list[Mistake] = [
    _capacity_flag("not a number", "many"),
    _capacity_flag("negative", "a=-1"),
    _capacity_flag("a digit of another script", "\u0663"),
    _capacity_flag("no name before =", "=3"),
    _capacity_flag("empty flag", ""),
    _capacity_flag("no such node, flag", "c=1", "c is no node; the nodes are a, b"),
    (
        "no such node, env, hidden by a flag",
        {**TWO, "capacity": ["a=2"]},
        {"TRIO_FAILOVER_CAPACITY": "2,a=1,gpu-z=1"},
        None,
        ("TRIO_FAILOVER_CAPACITY", "capacity", "gpu-z=1", "gpu-z is no node"),
    ),
    (
        "bare value twice",
        {**TWO, "capacity": ["1", "2"]},
        {},
        None,
        ("--capacity", "capacity", "2", "for every other node is given twice"),
    ),
    (
        "a node twice",
        {},
        {**{"TRIO_FAILOVER_UPSTREAMS": "a=http://h:1"}, "TRIO_FAILOVER_CAPACITY": "a=1,a=2"},
        None,
        ("TRIO_FAILOVER_CAPACITY", "capacity", "a=2", "of a is given twice"),
    ),
    (
        "top level negative",
        {},
        {},
        'capacity = -1\n[[upstream]]\nurl = "http://h:1"\n',
        ("config.toml:1", "capacity", -1, "whole number"),
    ),
    (
        "top level a string",
        {},
        {},
        'capacity = "4"\n[[upstream]]\nurl = "http://h:1"\n',
        ("config.toml:1", "capacity", "4", 'capacity = "4" is a string; write it as a number'),
    ),
    (
        "top level a bool",
        {},
        {},
        'capacity = true\n[[upstream]]\nurl = "http://h:1"\n',
        ("config.toml:1", "capacity", True, "whole number"),
    ),
    (
        "node in file, a float",
        {},
        {},
        '[[upstream]]\nurl = "http://h:1"\ncapacity = 1.5\n',
        ("config.toml:3", "upstream.capacity", 1.5, "whole number"),
    ),
]


@pytest.mark.parametrize(
    ("flags", "environ", "text", "error"),
    [pytest.param(*case[1:], id=case[0]) for case in CAPACITY_BAD],
)
def test_capacity_mistakes(
    flags: dict[str, Any],
    environ: dict[str, str],
    text: str | None,
    error: tuple[str, str, object, str],
) -> None:
    _assert_mistake(_only_mistake(flags, environ, text), error)


# --- The other new options ------------------------------------------------------------------------

# Each from a flag and from the environment: test_settings.py TEXT_VALUES.


def test_new_options_from_file() -> None:
    file = toml(
        """
        balance = "least-loaded"
        max_queue = 0
        discovery_interval = "0"

        [timeouts]
        queue = "45s"
        unstreamed = "1h"

        [[upstream]]
        url = "http://h:1"
        """
    )
    config, sources = resolve({}, {}, file)
    assert (config.balance, config.max_queue, config.discovery_interval) == ("least-loaded", 0, 0.0)
    assert (config.queue_timeout, config.unstreamed_timeout) == (45.0, 3600.0)
    assert str(sources["queue_timeout"]) == "file config.toml:6"
    assert str(sources["discovery_interval"]) == "file config.toml:3"


NEW_BAD: list[tuple[dict[str, Any], dict[str, str], str, str, object, str]] = [
    (
        {"balance": "round-robin"},
        {},
        "--balance",
        "balance",
        "round-robin",
        "one of priority, least-loaded",
    ),
    ({"max_queue": "-1"}, {}, "--max-queue", "max-queue", "-1", "must not be negative"),
    (
        {},
        {"TRIO_FAILOVER_QUEUE_TIMEOUT": "2"},
        "TRIO_FAILOVER_QUEUE_TIMEOUT",
        "queue-timeout",
        "2",
        "needs a unit",
    ),
    (
        {"unstreamed_timeout": "0"},
        {},
        "--unstreamed-timeout",
        "unstreamed-timeout",
        "0",
        "greater than zero",
    ),
    (
        {"discovery_interval": "-5s"},
        {},
        "--discovery-interval",
        "discovery-interval",
        "-5s",
        "negative",
    ),
]


@pytest.mark.parametrize(("flags", "environ", "source", "option_", "value", "expected"), NEW_BAD)
def test_new_options_bad_values(
    flags: dict[str, Any],
    environ: dict[str, str],
    source: str,
    option_: str,
    value: object,
    expected: str,
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve({**NODE, **flags}, environ)
    assert (info.value.source, info.value.option, info.value.value) == (source, option_, value)
    assert expected in info.value.expected


def test_unknown_key_in_timeouts_lists_the_new_ones() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({}, {}, toml('[[upstream]]\nurl = "http://h:1"\n[timeouts]\nqueu = "1s"\n'))
    assert "did you mean queue?" in info.value.expected
    assert "unstreamed" in info.value.expected


# --- Client keys ----------------------------------------------------------------------------------


def test_api_keys_from_flags() -> None:
    config, sources = resolve(
        {**NODE, "api_key": ["alice=sk-alice", "sk-second", "ci=dGVzdA=="]}, {}
    )
    assert config.clients == (
        ClientKey("alice", "sk-alice"),
        ClientKey("key-2", "sk-second"),
        ClientKey("ci", "dGVzdA=="),
    )
    assert str(sources["client:alice"]) == "flag --api-key"
    assert str(sources["clients"]) == "flag --api-key"


def test_api_keys_from_env() -> None:
    config, sources = resolve(NODE, {"TRIO_FAILOVER_API_KEYS": " sk-first , bob=sk-bob "})
    assert config.clients == (ClientKey("key-1", "sk-first"), ClientKey("bob", "sk-bob"))
    assert str(sources["client:bob"]) == "env TRIO_FAILOVER_API_KEYS"


CLIENT_FILE = """
[[client]]
name = "alice"
key = "${ALICE_KEY}"

[[client]]
key = "literal-key"

[[upstream]]
url = "http://h:1"
"""


def test_api_keys_from_file() -> None:
    config, sources = resolve({}, {"ALICE_KEY": "sk-alice"}, toml(CLIENT_FILE))
    assert config.clients == (ClientKey("alice", "sk-alice"), ClientKey("key-2", "literal-key"))
    assert str(sources["client:alice"]) == "file config.toml:1"
    assert str(sources["client:key-2"]) == "file config.toml:5"


def test_api_keys_lists_are_taken_whole_from_one_source() -> None:
    environ = {"ALICE_KEY": "sk-alice", "TRIO_FAILOVER_API_KEYS": "env-key"}
    config, _ = resolve({}, environ, toml(CLIENT_FILE))
    assert config.clients == (ClientKey("key-1", "env-key"),)
    config, _ = resolve({"api_key": ["flag-key"]}, environ, toml(CLIENT_FILE))
    assert config.clients == (ClientKey("key-1", "flag-key"),)


def test_api_keys_in_a_hidden_source_are_still_checked() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({"api_key": ["flag-key"]}, {}, toml(CLIENT_FILE))
    assert info.value.source == "config.toml:3"
    assert "ALICE_KEY is not set; client alice needs it for its key" in info.value.expected


def test_keys_and_token_are_masked_in_check_and_repr() -> None:
    config, sources = resolve(
        {**NODE, "api_key": ["alice=sk-alice-secret"], "admin_token": "tok-secret"}, {}
    )
    rows = {row[0]: row[1:] for row in describe(config, sources)}
    assert rows["api-key alice"] == ("***", "flag --api-key")
    assert rows["admin-token"] == ("***", "flag --admin-token")
    for text in (repr(rows), repr(config), repr(config.clients), repr(sources), str(sources)):
        assert "sk-alice-secret" not in text
        assert "tok-secret" not in text


SECRET = "Zq9-secret"

# Each case holds SECRET somewhere in a bad key or token; no error may show it.
# flags, environ, file text -> (source, option, value, expected)


def _in_file(
    case: str,
    clients: str,
    error: tuple[str, str, object, str],
    environ: dict[str, str] | None = None,
) -> Mistake:
    """A bad ``[[client]]`` in a config file that also has one node."""
    return (case, {}, environ or {}, f'{clients}[[upstream]]\nurl = "{URL}"\n', error)


KEY_BAD: list[Mistake] = [
    (
        "empty key",
        {**NODE, "api_key": ["alice="]},
        {},
        None,
        ("--api-key", "api-key", "alice", "the key of client alice is empty"),
    ),
    (
        "blank in a key",
        {**NODE, "api_key": [f"alice={SECRET} x"]},
        {},
        None,
        ("--api-key", "api-key", "alice", "holds blanks"),
    ),
    (
        "unnamed key with =",
        {**NODE, "api_key": [f"{SECRET}=="]},
        {},
        None,
        ("--api-key", "api-key", "key-1", "needs a name in front"),
    ),
    (
        "not a name before =",
        {**NODE, "api_key": [f"x/{SECRET}=y"]},
        {},
        None,
        ("--api-key", "api-key", "key-1", "NAME 1-128 token characters"),
    ),
    (
        "duplicate names",
        {**NODE, "api_key": [f"a={SECRET}", "a=other"]},
        {},
        None,
        ("--api-key", "api-key", "a", "client names must be unique"),
    ),
    (
        "duplicate keys",
        {},
        {"TRIO_FAILOVER_UPSTREAMS": URL, "TRIO_FAILOVER_API_KEYS": f"a={SECRET},b={SECRET}"},
        None,
        ("TRIO_FAILOVER_API_KEYS", "api-key", "b", "the same key as client a"),
    ),
    (
        "empty env",
        NODE,
        {"TRIO_FAILOVER_API_KEYS": " "},
        None,
        ("TRIO_FAILOVER_API_KEYS", "api-key", "", "no key in it"),
    ),
    (
        "empty admin token",
        {**NODE, "admin_token": ""},
        {},
        None,
        ("--admin-token", "admin-token", "***", "visible ASCII"),
    ),
    (
        "admin token with a blank",
        NODE,
        {"TRIO_FAILOVER_ADMIN_TOKEN": f"{SECRET} x"},
        None,
        ("TRIO_FAILOVER_ADMIN_TOKEN", "admin-token", "***", "visible ASCII"),
    ),
    _in_file(
        "file: weight not positive",
        '[[client]]\nname = "a"\nweight = 0\n',
        ("config.toml:3", "client.weight", 0, "a weight is a positive number"),
    ),
    _in_file(
        "file: unknown priority",
        '[[client]]\nname = "a"\npriority = "urgent"\n',
        ("config.toml:3", "client.priority", "urgent", "one of high, normal, low"),
    ),
    _in_file(
        "file: negative rpm",
        '[[client]]\nname = "a"\nkey = "k-a"\nrpm = -1\n',
        ("config.toml:4", "client.rpm", -1, "expected an integer >= 0"),
    ),
    _in_file(
        # A table without a key names the client a header picks: it needs a name.
        "file: neither key nor name",
        "[[client]]\nweight = 2\n",
        ("config.toml:1", "client.name", "key-1", "a client without a key needs a name"),
    ),
    _in_file(
        "file: key not a string",
        "[[client]]\nkey = 12\n",
        ("config.toml:2", "client.key", "key-1", "must be a string"),
    ),
    _in_file(
        "file: unset variable",
        f'[[client]]\nkey = "{SECRET}${{NOPE}}"\n',
        (
            "config.toml:2",
            "client.key",
            "${NOPE}",
            "NOPE is not set; client key-1 needs it for its key",
        ),
    ),
    _in_file(
        "file: empty variable",
        '[[client]]\nname = "ci"\nkey = "${EMPTY}"\n',
        (
            "config.toml:3",
            "client.key",
            "${EMPTY}",
            "EMPTY is empty; client ci needs it for its key",
        ),
        {"EMPTY": ""},
    ),
    _in_file(
        "file: blank in the key",
        f'[[client]]\nkey = "{SECRET} x"\n',
        ("config.toml:2", "client.key", "key-1", "holds blanks"),
    ),
    _in_file(
        "file: bad name",
        f'[[client]]\nname = "a b"\nkey = "{SECRET}"\n',
        ("config.toml:3", "client.name", "a b", "a client name is"),
    ),
    _in_file(
        "file: unknown key",
        f'[[client]]\nkey = "k"\nkye = "{SECRET}"\n',
        ("config.toml:3", "client.kye", "kye", "unknown key in [[client]] (did you mean key?"),
    ),
    _in_file(
        "file: not tables",
        f'client = "{SECRET}"\n',
        ("config.toml:1", "client", "client", "client keys are [[client]] tables"),
    ),
    _in_file(
        "file: duplicate names",
        f'[[client]]\nname = "a"\nkey = "{SECRET}"\n[[client]]\nname = "a"\nkey = "k2"\n',
        ("config.toml:4", "client.name", "a", "also at config.toml:1"),
    ),
]


@pytest.mark.parametrize(
    ("flags", "environ", "text", "error"),
    [pytest.param(*case[1:], id=case[0]) for case in KEY_BAD],
)
def test_key_and_token_mistakes_never_show_the_secret(
    flags: dict[str, Any],
    environ: dict[str, str],
    text: str | None,
    error: tuple[str, str, object, str],
) -> None:
    got = _only_mistake(flags, environ, text)
    _assert_mistake(got, error)
    assert SECRET not in str(got)
    assert SECRET not in repr(got.args)


# --- Issue 21: retry statuses, ports, ${VAR} ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ok"), [("400", True), ("599", True), ("399", False), ("600", False), ("200", False)]
)
def test_retry_status_takes_400_to_599(text: str, ok: bool) -> None:
    if ok:
        config, _ = resolve({**NODE, "retry_status": text}, {})
        assert config.retry_status == frozenset({int(text)})
    else:
        with pytest.raises(ConfigError, match=f"{text} is outside 400-599"):
            resolve({**NODE, "retry_status": text}, {})


PORTS: list[tuple[dict[str, Any], dict[str, str], str, str]] = [
    (
        {**NODE, "listen": "127.0.0.1:65536"},
        {},
        "--listen",
        "port 65536 is out of range: 1-65535, or 0",
    ),
    (
        {**NODE, "admin_listen": "127.0.0.1:70000"},
        {},
        "--admin-listen",
        "port 70000 is out of range",
    ),
    (
        {"upstream": ["http://10.0.0.5:70000"]},
        {},
        "--upstream",
        "port 70000 is out of range: a node's port is 1-65535",
    ),
    ({"upstream": ["a=http://10.0.0.5:70000"]}, {}, "--upstream", "port 70000 is out of range"),
    (
        {},
        {"TRIO_FAILOVER_UPSTREAMS": "a=http://[::1]:99999"},
        "TRIO_FAILOVER_UPSTREAMS",
        "port 99999 is out of range",
    ),
    (
        {"upstream": ["a=http://10.0.0.5:0"]},
        {},
        "--upstream",
        "port 0 is out of range: a node's port is 1-65535",
    ),
    (
        {"upstream": ["a=http://10.0.0.5:80a"]},
        {},
        "--upstream",
        "the URL's port '80a' is not a number",
    ),
]


@pytest.mark.parametrize(("flags", "environ", "source", "expected"), PORTS)
def test_ports_out_of_range_say_so(
    flags: dict[str, Any], environ: dict[str, str], source: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(flags, environ)
    assert info.value.source == source
    assert expected in info.value.expected


def test_port_out_of_range_in_file() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({}, {}, toml('[[upstream]]\nname = "b"\nurl = "http://10.0.0.6:70000"\n'))
    assert (info.value.source, info.value.option) == ("config.toml:3", "upstream.url")
    assert info.value.expected == "port 70000 is out of range: a node's port is 1-65535"


def test_listen_port_zero_is_any_free_port() -> None:
    config, _ = resolve({**NODE, "listen": "127.0.0.1:0", "admin_listen": "[::1]:0"}, {})
    assert (config.listen, config.admin_listen) == ("127.0.0.1:0", "[::1]:0")


# --- Every mistake at once ------------------------------------------------------------------------

MANY_MISTAKES = """
listen = "0.0.0.0:80800"
retry_status = [200, 503]
capacity = -2

[timeouts]
connect = "5"
first_byte = "30s"

[[upstream]]
name = "gpu-a"
url = "http://10.0.0.5:8000"
headers = { Authorization = "Bearer ${GPU_A_KEY}", X-Other = "${EMPTY}" }

[[upstream]]
url = "http://10.0.0.6:port"
models = 3
"""


def test_every_mistake_is_reported_at_once() -> None:
    with pytest.raises(ConfigErrors) as info:
        resolve({"max_queue": "lots"}, {"EMPTY": ""}, toml(MANY_MISTAKES))
    got = [(error.source, error.option) for error in info.value.errors]
    assert got == [
        ("--max-queue", "max-queue"),
        ("config.toml:1", "listen"),
        ("config.toml:2", "retry_status"),
        ("config.toml:3", "capacity"),
        ("config.toml:6", "timeouts.connect"),
        ("config.toml:7", "timeouts.first_byte"),
        ("config.toml:12", "upstream.headers.Authorization"),
        ("config.toml:12", "upstream.headers.X-Other"),
        ("config.toml:15", "upstream.url"),
        ("config.toml:16", "upstream.models"),
    ]
    # Still a ConfigError, with the first mistake's fields, and one line per mistake.
    assert isinstance(info.value, ConfigError)
    assert info.value.source == "--max-queue"
    lines = str(info.value).splitlines()
    assert lines == [str(error) for error in info.value.errors]
    assert "node gpu-a needs it for its Authorization header" in lines[6]
    assert "EMPTY is empty; node gpu-a needs it for its X-Other header" in lines[7]


def test_one_mistake_is_a_plain_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        resolve({**NODE, "max_queue": "lots"}, {})
    assert type(info.value) is ConfigError


def test_a_file_that_is_not_toml_stops_at_once(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('listen = "a:1"\nconnect = 10s\n')
    with pytest.raises(ConfigError) as info:
        resolve({"max_queue": "lots", "config": str(path)}, {})
    assert type(info.value) is ConfigError
    assert (info.value.source, info.value.option) == (f"{path}:2", "config")


def test_run_server_scrubs_keys_and_token_from_its_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_failover.service import server

    class Stop(Exception):
        pass

    scrubbed: list[str] = []

    def configure_logging(*args: object, secrets: list[str], **kwargs: object) -> None:
        scrubbed.extend(secrets)
        raise Stop

    monkeypatch.setattr(server, "configure_logging", configure_logging)
    config = Config(
        upstreams=[Upstream("a", URL, headers={"X-Key": "header-secret"})],
        clients=[ClientKey("alice", "sk-alice-1"), ClientKey("bob", "sk-bob-22")],
        admin_token="token-333",
    )
    with pytest.raises(Stop):
        server.run_server(config)
    assert sorted(scrubbed) == ["header-secret", "sk-alice-1", "sk-bob-22", "token-333"]


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


@pytest.mark.parametrize("listener", ["client", "admin"])
async def test_serve_that_cannot_listen_raises_a_config_error(listener: str) -> None:
    from trio_failover.service.server import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        if listener == "client":
            config = Config(upstreams=[Upstream("a", URL)], listen=address, admin_listen=None)
        else:
            config = Config(
                upstreams=[Upstream("a", URL)], listen="127.0.0.1:0", admin_listen=address
            )
        errors: list[BaseException] = []
        with trio.fail_after(10):
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(serve, config)
                    pytest.fail("serve listened on a taken address")
            except BaseExceptionGroup as group:
                errors = _leaves(group)
    [error] = errors
    assert isinstance(error, ConfigError)
    option = "listen" if listener == "client" else "admin-listen"
    assert (error.option, error.value, error.source) == (option, address, f"--{option}")
    assert error.expected == f"cannot listen ({listener} listener): Address already in use"
    assert isinstance(error.__cause__, OSError)


# --- Issue 42: sharing the fleet ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "environ", "error"),
    [
        (
            {"fair_share": "maybe"},
            {},
            ("--fair-share", "fair-share", "maybe", "one of on, off"),
        ),
        (
            {},
            {"TRIO_FAILOVER_FAIR_SHARE": "yes"},
            ("TRIO_FAILOVER_FAIR_SHARE", "fair-share", "yes", "one of on, off"),
        ),
        (
            {"client_header": "X User"},
            {},
            ("--client-header", "client-header", "X User", "a header name"),
        ),
    ],
)
def test_sharing_options_name_option_source_and_value(
    flags: dict[str, Any], environ: dict[str, str], error: tuple[str, str, object, str]
) -> None:
    got = _only_mistake({**NODE, **flags}, environ, None)
    _assert_mistake(got, error)


def test_sharing_options_resolve() -> None:
    config, sources = resolve(
        {**NODE, "client_header": "X-OpenWebUI-User-Id"}, {"TRIO_FAILOVER_FAIR_SHARE": "off"}
    )
    assert (config.client_header, config.fair_share) == ("X-OpenWebUI-User-Id", "off")
    assert str(sources["fair_share"]) == "env TRIO_FAILOVER_FAIR_SHARE"
