"""Tests of the command line: typer's CliRunner in-process, and real subprocesses."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import attrs
import h11
import httpx
import pytest
import trio
from typer.testing import CliRunner

from trio_failover import __version__
from trio_failover.cli.cli import app
from trio_failover.core.config import Config

runner = CliRunner()
NODE = ["--upstream", "http://127.0.0.1:9001"]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own TRIO_FAILOVER_* variables must not leak into the tests."""
    for name in list(os.environ):
        if name.startswith("TRIO_FAILOVER_"):
            monkeypatch.delenv(name)


def table(output: str) -> dict[str, tuple[str, str]]:
    """``check``'s table as {option: (value, source)}; columns split on 2+ spaces."""
    rows: dict[str, tuple[str, str]] = {}
    for line in output.splitlines()[1:]:
        option, value, source = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        rows[option] = (value, source)
    return rows


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"trio-failover {__version__}\n"


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("serve", "check", "demo"):
        assert command in result.stdout


# --- check ----------------------------------------------------------------------------------------

PRECEDENCE: list[tuple[list[str], dict[str, str], bool, str, str]] = [
    ([], {}, False, "0", "default"),
    ([], {}, True, "3s", "file {file}:5"),
    (
        [],
        {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "2s"},
        True,
        "2s",
        "env TRIO_FAILOVER_FIRST_BODY_TIMEOUT",
    ),
    (
        ["--first-body-timeout", "1s"],
        {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "2s"},
        True,
        "1s",
        "flag --first-body-timeout",
    ),
]


@pytest.mark.parametrize(("args", "env", "use_file", "value", "source"), PRECEDENCE)
def test_check_precedence(
    tmp_path: Path, args: list[str], env: dict[str, str], use_file: bool, value: str, source: str
) -> None:
    file = tmp_path / "config.toml"
    file.write_text(
        '[[upstream]]\nurl = "http://127.0.0.1:9001"\n\n[timeouts]\nfirst_body = "3s"\n'
    )
    args = ["check", *args, *(["--config", str(file)] if use_file else NODE)]
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    assert table(result.stdout)["first-body-timeout"] == (value, source.format(file=file))


def test_check_explicit_zero_overrides_env_opt_in() -> None:
    env = {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "5s", "TRIO_FAILOVER_DEAD_PEER_TIMEOUT": "10s"}
    args = ["check", *NODE, "--first-body-timeout", "0", "--dead-peer-timeout", "0"]
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    rows = table(result.stdout)
    assert rows["first-body-timeout"] == ("0", "flag --first-body-timeout")
    assert rows["dead-peer-timeout"] == ("0", "flag --dead-peer-timeout")


def test_check_prints_every_source_and_masks_secrets(tmp_path: Path) -> None:
    file = tmp_path / "fleet.toml"
    file.write_text(
        textwrap.dedent(
            """\
            listen = "127.0.0.1:7000"

            [[upstream]]
            name = "gpu-a"
            url = "http://10.0.0.5:8000"
            models = ["qwen3:32b"]
            headers = { Authorization = "Bearer ${GPU_A_KEY}", X-Team = "team-secret" }
            """
        )
    )
    env = {"GPU_A_KEY": "sk-very-secret", "TRIO_FAILOVER_LOG_FORMAT": "json"}
    args = ["check", "--config", str(file), "--admin-listen", "off"]
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    assert "sk-very-secret" not in result.output
    assert "team-secret" not in result.output
    assert result.stdout.splitlines()[0].split() == ["option", "value", "source"]
    rows = table(result.stdout)
    assert rows["config"] == (str(file), "flag --config")
    assert rows["listen"] == ("127.0.0.1:7000", f"file {file}:1")
    assert rows["admin-listen"] == ("off", "flag --admin-listen")
    assert rows["log-format"] == ("json", "env TRIO_FAILOVER_LOG_FORMAT")
    assert rows["connect-timeout"] == ("10s", "default")
    assert rows["upstream gpu-a"] == (
        "http://10.0.0.5:8000 models=qwen3:32b headers=Authorization:***,X-Team:***",
        f"file {file}:3",
    )


def test_check_upstreams_from_env() -> None:
    env = {"TRIO_FAILOVER_UPSTREAMS": "a=http://10.0.0.5:8000, http://10.0.0.6:9000"}
    result = runner.invoke(app, ["check"], env=env)
    assert result.exit_code == 0, result.output
    rows = table(result.stdout)
    assert rows["upstream a"] == ("http://10.0.0.5:8000", "env TRIO_FAILOVER_UPSTREAMS")
    assert rows["upstream 10.0.0.6:9000"] == ("http://10.0.0.6:9000", "env TRIO_FAILOVER_UPSTREAMS")


# --- bad values: exit 2, one line naming option, source and value ---------------------------------

CONFIG_OK = '[[upstream]]\nurl = "http://127.0.0.1:9001"\n'

# args, env, file text -> what stderr must name (source, option, value)
BAD: list[tuple[str, list[str], dict[str, str], str | None, tuple[str, ...]]] = [
    ("no unit", [*NODE, "--first-body-timeout", "5"], {}, None, ("--first-body-timeout", "'5'")),
    (
        "no unit in env",
        NODE,
        {"TRIO_FAILOVER_FIRST_BODY_TIMEOUT": "5"},
        None,
        ("TRIO_FAILOVER_FIRST_BODY_TIMEOUT", "first-body-timeout", "'5'"),
    ),
    (
        "no unit in file",
        [],
        {},
        CONFIG_OK + '[timeouts]\nfirst_body = "5"\n',
        ("config.toml:4", "timeouts.first_body", "'5'"),
    ),
    ("negative", [*NODE, "--connect-timeout", "-1s"], {}, None, ("--connect-timeout", "'-1s'")),
    (
        "unknown choice",
        [*NODE, "--client-close", "later"],
        {},
        None,
        ("--client-close", "'later'", "abort, rst-only, ignore"),
    ),
    (
        "bad URL",
        ["--upstream", "gpu=10.0.0.5:8000"],
        {},
        None,
        ("--upstream", "'gpu=10.0.0.5:8000'", "http://"),
    ),
    (
        "duplicate names",
        [],
        {},
        CONFIG_OK + '[[upstream]]\nname = "127.0.0.1:9001"\nurl = "http://127.0.0.1:9002"\n',
        ("config.toml:3", "upstream.name", "'127.0.0.1:9001'", "unique"),
    ),
    ("no upstream", [], {}, None, ("--upstream", "upstream", "at least one node")),
    (
        "unknown key",
        [],
        {},
        CONFIG_OK + 'modles = ["x"]\n',
        ("config.toml:3", "upstream.modles", "unknown key", "models"),
    ),
    (
        "TOML syntax",
        [],
        {},
        CONFIG_OK + "[timeouts\n",
        ("config.toml:3", "not valid TOML"),
    ),
    (
        "undefined ${VAR}",
        [],
        {},
        CONFIG_OK + 'headers = { Authorization = "Bearer ${NOT_SET_ANYWHERE}" }\n',
        ("config.toml:3", "upstream.headers.Authorization", "NOT_SET_ANYWHERE is not set"),
    ),
    (
        "a success status to retry",
        [*NODE, "--retry-status", "200"],
        {},
        None,
        ("--retry-status", "'200'", "400-599"),
    ),
    (
        "port out of range",
        ["--upstream", "http://10.0.0.5:70000"],
        {},
        None,
        ("--upstream", "port 70000 is out of range"),
    ),
    (
        "capacity of no node",
        [*NODE, "--capacity", "gpu-z=2"],
        {},
        None,
        ("--capacity", "'gpu-z=2'", "gpu-z is no node"),
    ),
    (
        "unknown engine kind",
        [*NODE, "--engine", "gpu-a=tgi"],
        {},
        None,
        ("--engine", "'gpu-a=tgi'", "KIND one of auto, openai, ollama"),
    ),
    (
        "engine kind in the environment",
        NODE,
        {"TRIO_FAILOVER_ENGINES": "Ollama"},
        None,
        ("TRIO_FAILOVER_ENGINES", "'Ollama'", "KIND one of"),
    ),
    (
        "load interval without a unit",
        [*NODE, "--load-interval", "2"],
        {},
        None,
        ("--load-interval", "'2'"),
    ),
    (
        "cold start before it began",
        NODE,
        {"TRIO_FAILOVER_COLD_START_TIMEOUT": "-5m"},
        None,
        ("TRIO_FAILOVER_COLD_START_TIMEOUT", "'-5m'"),
    ),
    (
        "empty client key",
        NODE,
        {"TRIO_FAILOVER_API_KEYS": "alice="},
        None,
        ("TRIO_FAILOVER_API_KEYS", "'alice'", "the key of client alice is empty"),
    ),
]


@pytest.mark.parametrize("command", ["serve", "check"])
@pytest.mark.parametrize(
    ("args", "env", "text", "facts"), [pytest.param(*case[1:], id=case[0]) for case in BAD]
)
def test_bad_values_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    args: list[str],
    env: dict[str, str],
    text: str | None,
    facts: tuple[str, ...],
) -> None:
    _fake_server(monkeypatch, lambda config: pytest.fail("serve started with a bad config"))
    monkeypatch.chdir(tmp_path)
    if text is not None:
        Path("config.toml").write_text(text)
        args = [*args, "--config", "config.toml"]
    started = time.perf_counter()
    result = runner.invoke(app, [command, *args], env=env)
    assert time.perf_counter() - started < 1.0
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("trio-failover: error: ")
    for fact in facts:
        assert fact in lines[0]


@pytest.mark.parametrize("command", ["serve", "check"])
def test_several_mistakes_one_line_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    _fake_server(monkeypatch, lambda config: pytest.fail("serve started with a bad config"))
    file = tmp_path / "config.toml"
    file.write_text(
        'listen = "0.0.0.0:80800"\n[timeouts]\nconnect = "5"\nqueue = "x"\n'
        '[[upstream]]\nurl = "http://h:1"\ncapacity = -1\n'
    )
    result = runner.invoke(app, [command, "--config", str(file), "--max-queue", "-1"])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert [line.split(": ")[2] for line in lines] == [
        "--max-queue",
        f"{file}:1",
        f"{file}:3",
        f"{file}:4",
        f"{file}:7",
    ]
    assert all(line.startswith("trio-failover: error: ") for line in lines)


def test_check_takes_repeated_capacity_and_keys_and_masks_them() -> None:
    args = [
        "check",
        "--upstream",
        "a=http://10.0.0.5:8000",
        "--upstream",
        "b=http://10.0.0.6:8000",
        "--capacity",
        "2",
        "--capacity",
        "a=4",
        "--api-key",
        "alice=sk-alice-secret",
        "--api-key",
        "sk-other-secret",
        "--admin-token",
        "tok-secret",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = table(result.stdout)
    assert rows["capacity a"] == ("4", "flag --capacity")
    assert rows["capacity b"] == ("2", "flag --capacity")
    assert rows["api-key alice"] == ("***", "flag --api-key")
    assert rows["api-key key-2"] == ("***", "flag --api-key")
    assert rows["admin-token"] == ("***", "flag --admin-token")
    assert rows["balance"] == ("priority", "default")
    assert rows["queue-timeout"] == ("2m", "default")
    assert rows["max-queue"] == ("1000", "default")
    assert rows["discovery-interval"] == ("30s", "default")
    assert rows["unstreamed-timeout"] == ("10m", "default")
    assert rows["client-header"] == ("none", "default")
    assert rows["fair-share"] == ("on", "default")
    assert rows["affinity"] == ("prefix", "default")
    for secret in ("sk-alice-secret", "sk-other-secret", "tok-secret"):
        assert secret not in result.output


# --- serve and demo hand over to their modules ----------------------------------------------------


def _fake_server(monkeypatch: pytest.MonkeyPatch, run_server: object) -> None:
    module = types.ModuleType("trio_failover.service.server")
    module.run_server = run_server  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trio_failover.service.server", module)


def test_serve_runs_the_resolved_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Config] = []

    def run_server(config: Config, *, loader: object = None) -> int:
        seen.append(config)
        return 7

    _fake_server(monkeypatch, run_server)
    env = {"TRIO_FAILOVER_LISTEN": "127.0.0.1:0"}
    result = runner.invoke(app, ["serve", *NODE, "--admin-listen", "off"], env=env)
    assert result.exit_code == 7
    [config] = seen
    assert (config.listen, config.admin_listen) == ("127.0.0.1:0", None)
    assert [node.url for node in config.upstreams] == ["http://127.0.0.1:9001"]


def test_demo_runs_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []

    def run_demo(once: bool) -> int:
        calls.append(once)
        return 0

    module = types.ModuleType("trio_failover.demo")
    module.run_demo = run_demo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trio_failover.demo", module)
    assert runner.invoke(app, ["demo", "--once"]).exit_code == 0
    assert runner.invoke(app, ["demo"]).exit_code == 0
    assert calls == [True, False]


def test_serve_imports_neither_the_demo_nor_the_test_kit() -> None:
    # The layers keep them out of service/ and below; the command line may
    # import the demo, but only inside the demo command.
    probe = (
        "import sys, trio_failover.cli.cli, trio_failover.cli.reexec, "
        "trio_failover.service.server, trio_failover.service.workers; "
        "print(sorted(m for m in sys.modules "
        "if m.startswith(('trio_failover.demo', 'trio_failover.testing'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- real subprocesses ----------------------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_FAILOVER_")}
    env.update(extra)
    return env


def _run(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "trio_failover", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env or _clean_env(),
        check=False,
    )
    return result, time.perf_counter() - started


def _children_cpu() -> float:
    """CPU seconds used so far by the finished children of this process."""
    times = os.times()
    return times.children_user + times.children_system


def test_subprocess_bad_value_exits_2_within_a_second() -> None:
    # On a loaded host (a busy CI runner, two cores shared with other jobs) a
    # child waits for a core longer than it runs: its wall time says more
    # about the neighbours than about us, its CPU time does not.
    before = _children_cpu()
    version, baseline = _run("--version")
    between = _children_cpu()
    assert (version.returncode, version.stdout) == (0, f"trio-failover {__version__}\n")
    # The interpreter's own start-up is not ours to judge: measure beyond it.
    result, elapsed = _run(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9001",
        env=_clean_env(TRIO_FAILOVER_DEAD_PEER_TIMEOUT="30"),
    )
    after = _children_cpu()
    assert (after - between) - (between - before) < 1.0  # the work, whatever the load
    # Waiting (on a node, a port, a timer) costs no CPU: the wall clock
    # catches it, with room for a host that runs us at a third of a core.
    assert elapsed - baseline < 5.0
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "trio-failover: error: TRIO_FAILOVER_DEAD_PEER_TIMEOUT: invalid value '30' for "
        "dead-peer-timeout: a duration needs a unit (h, m, s, ms, us or ns), as in 10s; "
        "only 0 may go without"
    ]


@pytest.mark.parametrize(
    ("option", "listener", "other"),
    [
        ("--listen", "client", ["--admin-listen", "off"]),
        ("--admin-listen", "admin", ["--listen", "127.0.0.1:0"]),
    ],
)
def test_subprocess_cannot_listen_exits_2_naming_the_listener(
    option: str, listener: str, other: list[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result, _ = _run("serve", "--upstream", "http://127.0.0.1:9001", option, address, *other)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"trio-failover: error: {option}: invalid value {address!r} for {option[2:]}: "
        f"cannot listen ({listener} listener): Address already in use"
    ]


@pytest.mark.parametrize(
    ("how", "listener", "workers"),
    [
        ("env", "client", "1"),
        ("file", "client", "1"),
        ("env", "admin", "1"),
        ("file", "admin", "1"),
        ("file", "client", "2"),  # the supervisor binds for its workers
        ("env", "admin", "2"),
    ],
)
def test_subprocess_cannot_listen_names_where_the_address_was_set(
    tmp_path: Path, how: str, listener: str, workers: str
) -> None:
    key = "listen" if listener == "client" else "admin_listen"
    other = {"listen": "127.0.0.1:0", "admin_listen": "off"}
    del other[key]
    args = ["serve", "--upstream", "http://127.0.0.1:9001", "--workers", workers]
    args += ["--state", "redis://127.0.0.1:9"] if workers != "1" else []  # workers share one
    args += [f"--{name.replace('_', '-')}={value}" for name, value in other.items()]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        if how == "env":
            source, label = f"TRIO_FAILOVER_{key.upper()}", key.replace("_", "-")
            env = _clean_env(**{source: address})
        else:
            config = tmp_path / "config.toml"
            config.write_text(f'# taken\n\n{key} = "{address}"\n')
            source, label = f"{config}:3", key
            env = _clean_env(TRIO_FAILOVER_CONFIG=str(config))
        result, _ = _run(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"trio-failover: error: {source}: invalid value {address!r} for {label}: "
        f"cannot listen ({listener} listener): Address already in use"
    ]


def test_subprocess_check_shows_all_four_sources(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[[upstream]]\nurl = "http://127.0.0.1:9001"\n\n'
        '[timeouts]\nfirst_body = "3s"\nconnect = "3s"\nresponse_header = "3s"\n'
    )
    env = _clean_env(
        TRIO_FAILOVER_CONFIG=str(config),
        TRIO_FAILOVER_FIRST_BODY_TIMEOUT="2s",  # an opt-in...
        TRIO_FAILOVER_CONNECT_TIMEOUT="2s",
    )
    result, _ = _run("check", "--first-body-timeout", "0", env=env)  # ...that 0 turns off
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert rows["config"] == (str(config), "env TRIO_FAILOVER_CONFIG")
    assert rows["first-body-timeout"] == ("0", "flag --first-body-timeout")
    assert rows["connect-timeout"] == ("2s", "env TRIO_FAILOVER_CONNECT_TIMEOUT")
    assert rows["response-header-timeout"] == ("3s", f"file {config}:7")
    assert rows["stream-idle-timeout"] == ("5m", "default")


def test_subprocess_check_reports_every_mistake_of_a_file_at_once(tmp_path: Path) -> None:
    """A node's bad name does not hide its bad URL; a misspelt timeout at the top gets a hint."""
    config = tmp_path / "config.toml"
    config.write_text(
        'respone_header = "5s"\n\n[[upstream]]\nname = "gpu a"\nurl = "ftp://10.0.0.5:8000"\n'
    )
    result, _ = _run("check", "--config", str(config))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith(
        f"trio-failover: error: {config}:1: invalid value 'respone_header' for respone_header: "
        "unknown key at the top level (did you mean response_header in [timeouts]?)"
    )
    assert lines[1:] == [
        f"trio-failover: error: {config}:4: invalid value 'gpu a' for upstream.name: "
        "a node name is 1-128 token characters, no spaces",
        f"trio-failover: error: {config}:5: invalid value 'ftp://10.0.0.5:8000' for upstream.url: "
        "expected an http:// or https:// URL with a host",
    ]


# The routing test: two fake nodes in this process, a real `serve` subprocess.


@attrs.define
class Received:
    """What one fake node saw of one request."""

    node: str
    target: str
    headers: dict[str, str]
    body: dict[str, object]


async def _fake_node(
    name: str, log: list[Received], *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """A minimal OpenAI-style node: records each request, answers 200 with JSON."""

    async def handle(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            request: h11.Request | None = None
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            if request is None:
                return
            log.append(
                Received(
                    name,
                    request.target.decode(),
                    {k.decode(): v.decode() for k, v in request.headers},
                    json.loads(body),
                )
            )
            answer = json.dumps({"node": name}).encode()
            headers = [("content-type", "application/json"), ("content-length", str(len(answer)))]
            await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
            await stream.send_all(conn.send(h11.Data(data=answer)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_serve_routes_by_model_with_node_headers(tmp_path: Path) -> None:
    log: list[Received] = []
    output: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port_a = await nursery.start(_fake_node, "node-a", log)
            port_b = await nursery.start(_fake_node, "node-b", log)
            config = tmp_path / "config.toml"
            config.write_text(
                textwrap.dedent(
                    f"""\
                    listen = "127.0.0.1:9"   # overridden by --listen

                    [timeouts]
                    connect = "2s"

                    [[upstream]]
                    name = "node-a"
                    url = "http://127.0.0.1:{port_a}"
                    models = ["qwen3:32b"]
                    headers = {{ X-Node-Key = "key-a" }}

                    [[upstream]]
                    name = "node-b"
                    url = "http://127.0.0.1:{port_b}"
                    models = {{ "*" = "other" }}
                    headers = {{ Authorization = "Bearer ${{NODE_B_KEY}}" }}
                    """
                )
            )
            command = [
                sys.executable, "-m", "trio_failover", "serve",
                "--config", str(config), "--listen", "127.0.0.1:0", "--admin-listen", "off",
                "--discovery-interval", "0",  # the nodes log every request they get
            ]  # fmt: skip
            proc = await trio.lowlevel.open_process(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=_clean_env(NODE_B_KEY="secret-b"),
            )
            try:
                assert proc.stdout is not None
                url = await _wait_listening(proc.stdout, output)
                nursery.start_soon(_drain, proc.stdout, output)
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    first = await client.post(
                        "/v1/chat/completions", json={"model": "qwen3:32b", "messages": []}
                    )
                    second = await client.post(
                        "/v1/chat/completions", json={"model": "llama3:8b", "messages": []}
                    )
            finally:
                proc.terminate()
                with trio.move_on_after(10):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            nursery.cancel_scope.cancel()

    assert (first.status_code, first.json()) == (200, {"node": "node-a"}), output
    assert (second.status_code, second.json()) == (200, {"node": "node-b"}), output
    assert first.headers["x-failover-node"] == "node-a"
    assert second.headers["x-failover-node"] == "node-b"
    a, b = log
    # node-a lists the model: it gets the client's name and its own header.
    assert (a.node, a.target, a.body["model"]) == ("node-a", "/v1/chat/completions", "qwen3:32b")
    assert a.headers["x-node-key"] == "key-a"
    assert "authorization" not in a.headers
    # Only node-b serves llama3:8b (through "*"), under its own name, with its header.
    assert (b.node, b.body["model"]) == ("node-b", "other")
    assert b.headers["authorization"] == "Bearer secret-b"
    assert "x-node-key" not in b.headers


async def _wait_listening(stream: trio.abc.ReceiveStream, output: list[str]) -> str:
    """Read the subprocess's output until its `listening on http://...` line."""
    buffer = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise AssertionError("serve exited before listening:\n" + buffer.decode())
        buffer += data
        match = re.search(rb"listening on (http://[0-9.]+:[0-9]+)", buffer)
        if match:
            output.append(buffer.decode(errors="replace"))
            return match.group(1).decode()


async def _drain(stream: trio.abc.ReceiveStream, output: list[str]) -> None:
    """Keep reading so the proxy never blocks on a full pipe; keep it for failure messages."""
    while data := await stream.receive_some(65536):
        output.append(data.decode(errors="replace"))
