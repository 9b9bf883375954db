"""Fixtures of the end-to-end suite: a fleet per test, a report per session."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import ENGINES, Engine, HarnessError, Manifest, Process, Proxy, Tap
from prepare import manifest_path
from report import Report

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = Path(sys.executable).parent / "trio-failover"
OUT = ROOT / "build" / "e2e"


class Fleet:
    """The engines, taps and proxy of one test; ``close`` ends every one of them."""

    def __init__(self, manifest: Manifest, log_dir: Path, proxy_args: list[str]):
        self.manifest = manifest
        self.proxy_args = proxy_args
        self.log_dir = log_dir
        self.processes: list[Process] = []
        self.taps: list[Tap] = []

    def engines(self, kind: str, *names: str, **settings: Any) -> list[Engine]:
        """Start one engine per name (all at once, they load in parallel), wait for all."""
        started = []
        for name in names:
            engine = ENGINES[kind].start(self.manifest, name, self.log_dir, **settings)
            self.processes.append(engine)
            started.append(engine)
        for engine in started:
            engine.wait_ready()
        return started

    def engine(self, kind: str, name: str = "a", **settings: Any) -> Engine:
        return self.engines(kind, name, **settings)[0]

    def tap(self, engine: Engine) -> Tap:
        tap = Tap(engine.port)
        self.taps.append(tap)
        return tap

    def proxy(self, upstreams: list[tuple[str, str]], *extra: str) -> Proxy:
        # --proxy-arg flags come last: they override the test's own.
        proxy = Proxy.start(PROGRAM, upstreams, [*extra, *self.proxy_args], self.log_dir)
        self.processes.append(proxy)
        proxy.wait_ready()
        return proxy

    def close(self) -> None:
        errors = []
        for process in reversed(self.processes):
            try:
                process.stop()
            except Exception as exc:  # keep stopping the others
                errors.append(f"{process.name}: {exc!r}")
        for tap in self.taps:
            tap.close()
        if errors:
            raise HarnessError("could not stop: " + "; ".join(errors))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--proxy-arg",
        action="append",
        default=[],
        help="one more argument for every proxy the suite starts (to break it on purpose: "
        "--proxy-arg=--client-close --proxy-arg=ignore)",
    )


@pytest.fixture(scope="session")
def manifest() -> Manifest:
    path = manifest_path()
    if not path.exists():
        pytest.exit(f"{path} is missing: run `make e2e` (or python e2e/prepare.py) first", 2)
    import json

    return Manifest(json.loads(path.read_text()))


@pytest.fixture(scope="session")
def report(manifest: Manifest) -> Iterator[Report]:
    report = Report(versions(manifest))
    yield report
    report.write(OUT)


@pytest.fixture
def log_dir(request: pytest.FixtureRequest) -> Path:
    folder = OUT / "logs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.log"):
        old.unlink()
    return folder


@pytest.fixture
def fleet(manifest: Manifest, log_dir: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    fleet = Fleet(manifest, log_dir, request.config.getoption("proxy_arg"))
    try:
        yield fleet
    finally:
        fleet.close()


def versions(manifest: Manifest) -> dict[str, str]:
    server = manifest.data["llama_server"]
    found = subprocess.run(
        [server["binary"], "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"LD_LIBRARY_PATH": server["lib_dir"]},
    )
    build = " ".join(line for line in (found.stdout + found.stderr).splitlines() if line.strip())
    proxy = subprocess.run([str(PROGRAM), "--version"], capture_output=True, text=True, timeout=30)
    return {
        "proxy": proxy.stdout.strip(),
        "llama-cpp-python": manifest.data["llama_cpp_python"]["version"],
        "llama-server": f"{server['version']} ({build})",
        "model": manifest.data["model"]["package"] + " (" + Path(manifest.model).name + ")",
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    result = outcome.get_result()
    if result.failed and "log_dir" in getattr(item, "funcargs", {}):
        result.sections.append(("e2e logs", str(item.funcargs["log_dir"])))  # type: ignore[attr-defined]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    Report.outcomes_seen(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if (OUT / "report.md").exists():
        terminalreporter.write_line(f"e2e report: {OUT / 'report.md'}")
