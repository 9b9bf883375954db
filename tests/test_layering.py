"""Guards for the layering rules of STYLE.md sections 1 and 2.

1. The layers, the core's freedom from I/O and the clock, and the absence
   of import cycles are import-linter's contracts (``[tool.importlinter]``
   in pyproject.toml, run by ``make lint``). Here they are run once on the
   package, and once on copies of it with one import added, so each
   contract is seen to break when it should.
2. No module of the package reads or waits on the OS clock: deadlines use
   Trio's clock, log stamps logging's record time, and a Retry-After date
   is measured against the response's own Date header. import-linter
   cannot say that: ``logs.py`` imports ``time`` to format, not to read
   the clock. Checked on the source with ``ast``, never by importing; the
   checker is also run on small made-up sources.

What else import-linter cannot say, the core's use of the standard library
and ``attrs`` only, is ``tests/test_core_purity.py``.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "trio_failover"
ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / PACKAGE
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# -- the import contracts -----------------------------------------------------------

LAYERS = "Each folder is one layer; imports only go down"
SHELL = "The shell's folders are layers too; imports only go down"
SHIPPED = "The shipped proxy never imports the test kit or the demo"
CORE = "The core does no I/O and reads no clock"
SETTINGS = "The settings need no Trio, sockets or clock"
CYCLES = "No import cycles, in the package or in any of its folders"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package and pyproject.toml under ``root``."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=root,  # lint-imports puts the working directory first on sys.path
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_import_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in (LAYERS, SHELL, SHIPPED, CORE, SETTINGS, CYCLES):
        assert f"{name} KEPT" in result.stdout
    assert "Contracts: 6 kept, 0 broken." in result.stdout


BREAKS = [
    # An import up from below the shell makes chains up inside it too.
    pytest.param(
        "core/ranking.py", "from ..proxy import proxy", [LAYERS, SHELL, CORE, CYCLES], id="up"
    ),
    pytest.param(
        "wire/fetch.py", "from ..service import server", [LAYERS, SHELL, CYCLES], id="up-two"
    ),
    pytest.param(
        "wire/client.py", "from ..telemetry import logs", [LAYERS], id="sibling-telemetry"
    ),
    pytest.param("telemetry/events.py", "from ..wire import http1", [LAYERS], id="sibling-wire"),
    pytest.param("core/cooldown.py", "import time", [CORE], id="core-clock"),
    pytest.param(
        "core/units.py",
        "import typing\nif typing.TYPE_CHECKING:\n    import trio",
        [CORE, SETTINGS],  # the settings import core/units.py
        id="core-type-checking",
    ),
    pytest.param("cli/settings/kinds.py", "import trio", [SETTINGS], id="settings-trio"),
    pytest.param("core/errors.py", "from .config import Config", [CYCLES], id="cycle-core"),
    pytest.param(
        "proxy/nodes/queue.py", "from .ticker import EXPIRY_TICK", [CYCLES], id="cycle-proxy-queue"
    ),
    pytest.param(
        "proxy/nodes/board.py",
        "from ..request import workload",
        [SHELL, CYCLES],
        id="shell-nodes-up-to-request",
    ),
    # request/ and fleet/ are siblings: neither way is allowed.
    pytest.param(
        "proxy/request/relay.py", "from ..fleet import fleet", [SHELL], id="shell-request-fleet"
    ),
    pytest.param(
        "proxy/fleet/spare_leases.py",
        "from ..request import answers",
        [SHELL],
        id="shell-fleet-request",
    ),
    pytest.param(
        "proxy/records.py", "from . import report", [SHELL, CYCLES], id="shell-records-up"
    ),
    pytest.param("proxy/extra.py", "", [SHELL], id="shell-module-without-a-layer"),
    pytest.param("extra/__init__.py", "", [LAYERS], id="folder-without-a-layer"),
    pytest.param("extra.py", "", [LAYERS], id="root-module-without-a-layer"),
    pytest.param(
        "wire/http1.py", "from ..testing import fakes", [LAYERS, SHIPPED, CYCLES], id="wire-kit"
    ),
    pytest.param("service/admin.py", "from .. import demo", [LAYERS, SHIPPED, CYCLES], id="demo"),
    pytest.param("testing/fakes.py", "from .. import demo", [LAYERS, CYCLES], id="kit-demo"),
    pytest.param("telemetry/logs.py", "from .. import cli", [LAYERS, CYCLES], id="up-to-cli"),
]


@pytest.mark.parametrize(("module", "line", "broken"), BREAKS)
def test_a_bad_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, broken: list[str]
) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(PACKAGE_DIR, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / PACKAGE / module
    path.parent.mkdir(exist_ok=True)
    source = path.read_text(encoding="utf-8") if path.exists() else ""
    path.write_text(f"{source}\n{line}  # noqa\n", encoding="utf-8")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    expected = {name: name in broken for name in (LAYERS, SHELL, SHIPPED, CORE, SETTINGS, CYCLES)}
    found = {name: f"{name} BROKEN" in result.stdout for name in expected}
    assert found == expected, result.stdout


def test_the_core_package_init_imports_nothing() -> None:
    # Importing any core module runs core/__init__.py first; the contracts
    # allow it sibling imports, this keeps it empty.
    tree = ast.parse((PACKAGE_DIR / "core" / "__init__.py").read_text(encoding="utf-8"))
    assert [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)] == []


def test_every_folder_says_what_it_holds_and_may_import() -> None:
    # The package's map, folder by folder, in the place a reader opens first.
    folders = sorted(path.parent for path in PACKAGE_DIR.rglob("__init__.py"))
    assert PACKAGE_DIR / "testing" in folders
    silent = []
    for folder in folders[1:]:  # not the package's own: the public names
        source = (folder / "__init__.py").read_text(encoding="utf-8")
        if "import" not in (ast.get_docstring(ast.parse(source)) or ""):
            silent.append(folder.relative_to(PACKAGE_DIR).as_posix())
    assert silent == []


# -- the OS clock ---------------------------------------------------------------------------

CLOCK_FUNCTIONS = frozenset(
    {"sleep", "monotonic", "monotonic_ns", "time", "time_ns", "perf_counter", "perf_counter_ns"}
)


def clock_uses(source: str) -> list[tuple[int, str | None]]:
    """``(line, enclosing top-level function)`` of each use of an OS clock function.

    A use is ``time.sleep`` (or ``t.sleep`` after ``import time as t``), or
    any name bound by ``from time import sleep``, called or not: handing
    ``time.monotonic`` to a library is reading the clock all the same.
    """
    tree = ast.parse(source)
    module_names: set[str] = set()  # what "time" is called in this file
    direct: set[str] = set()  # clock functions imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            module_names.update(a.asname or a.name for a in node.names if a.name == "time")
        elif isinstance(node, ast.ImportFrom) and node.module == "time" and not node.level:
            for alias in node.names:
                if alias.name in CLOCK_FUNCTIONS or alias.name == "*":
                    direct.add(alias.asname or alias.name)
    uses: list[tuple[int, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(node, ast.Module) and isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef
            ):
                inner = child.name  # only top-level functions name a place
            attribute_use = (
                isinstance(child, ast.Attribute)
                and child.attr in CLOCK_FUNCTIONS
                and isinstance(child.value, ast.Name)
                and child.value.id in module_names
            )
            name_use = isinstance(child, ast.Name) and child.id in direct
            star_import = (
                isinstance(child, ast.ImportFrom) and child.module == "time" and "*" in direct
            )
            if attribute_use or name_use or star_import:
                assert isinstance(child, ast.expr | ast.stmt)
                uses.append((child.lineno, inner))
            visit(child, inner)

    visit(tree, None)
    return uses


def _package_files() -> list[Path]:
    files = sorted(PACKAGE_DIR.glob("**/*.py"))
    assert len(files) > 10  # the glob really found the package
    return files


# The one function that reads the wall clock (STYLE 2: "wall-clock time only
# through one replaceable function"): the traces' epoch timestamps.
WALL_CLOCK = ("telemetry/tracing.py", "wall_clock_ns")


def test_no_module_reads_the_os_clock() -> None:
    # Deadlines read Trio's clock; log stamps come from logging's own record
    # time; a Retry-After date is measured against the response's Date; span
    # timestamps are Trio times shifted by one offset from WALL_CLOCK.
    uses = [
        (path.relative_to(PACKAGE_DIR).as_posix(), line, function)
        for path in _package_files()
        for line, function in clock_uses(path.read_text(encoding="utf-8"))
    ]
    offenders = [
        f"{name}:{line}" for name, line, function in uses if (name, function) != WALL_CLOCK
    ]
    assert offenders == []
    assert [(name, function) for name, _, function in uses] == [WALL_CLOCK]


CLOCK_SOURCES = [
    pytest.param("import time\ntime.sleep(1)", [(2, None)], id="sleep"),
    pytest.param("import time\ndef f():\n    return time.monotonic()", [(3, "f")], id="monotonic"),
    pytest.param("import time as t\nx = t.time()", [(2, None)], id="aliased-module"),
    pytest.param("from time import monotonic as m\nm()", [(2, None)], id="aliased-function"),
    pytest.param(
        "from time import perf_counter\nclock = perf_counter", [(2, None)], id="reference"
    ),
    pytest.param("from time import *\nx = 1", [(1, None)], id="star"),
    pytest.param(
        "import time\nclass C:\n    def m(self):\n        time.sleep(0)",
        [(4, None)],
        id="method-is-not-a-function",
    ),
    pytest.param(
        "import time\nasync def f():\n    def g():\n        time.time()",
        [(4, "f")],
        id="nested-counts-as-outer",
    ),
    pytest.param("import time\nstamp = time.strftime('%Y', time.gmtime(0))", [], id="formatting"),
    pytest.param("import trio\nnow = trio.current_time()", [], id="trio-clock"),
    pytest.param("def sleep():\n    pass\nsleep()", [], id="own-name-sleep"),
    pytest.param("import datetime\ndatetime.time()", [], id="datetime-time"),
]


@pytest.mark.parametrize(("source", "uses"), CLOCK_SOURCES)
def test_clock_uses_finds_violations(source: str, uses: list[tuple[int, str | None]]) -> None:
    assert clock_uses(source) == uses
