"""Guards for the layering rules of STYLE.md sections 1 and 2.

1. The pure modules (and what they import from the package, transitively)
   import neither Trio, h11, sockets, asyncio nor ``time``: they decide from
   data and a ``now`` handed in.
2. No module of the package reads or waits on the OS clock: deadlines use
   Trio's clock, log stamps logging's record time, and a Retry-After date
   is measured against the response's own Date header.

Both are checked on the source with ``ast``, never by importing: an import
would run the package's ``__init__`` and prove nothing about one module. The
package ``__init__`` itself is not followed (it re-exports everything); every
import statement counts, including those under ``if TYPE_CHECKING:``.
Each checker is also run on small made-up sources, so the guard is seen to
fail when it should.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PACKAGE = "trio_failover"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

# Every module of core/, also those added later: the folder is the rule.
PURE_MODULES = sorted(
    f"core.{path.stem}" for path in (PACKAGE_DIR / "core").glob("*.py") if path.stem != "__init__"
)
# Known members, so that an emptied or renamed folder cannot pass vacuously.
KNOWN_PURE = ["ranking", "cooldown", "outcome", "headers", "units", "config", "workload"]
FORBIDDEN = frozenset({"trio", "h11", "socket", "time", "asyncio", "trio_websocket"})

# -- the import graph -------------------------------------------------------------------


def _imports(source: str, module: str) -> Iterator[tuple[str, bool]]:
    """``(absolute name, certain)`` for every module an import in ``source`` names.

    ``from .x import y`` gives ``pkg.x`` (certain) and ``pkg.x.y`` (not
    certain: ``y`` may be a submodule or just a name in ``pkg.x``).
    """
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, True
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base_parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield base, True
            for alias in node.names:
                yield f"{base}.{alias.name}", False
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
        ):
            yield "__import__", True  # a dynamic import: not allowed in a pure module


def _package_source(module: str) -> str | None:
    """The source of a package module, or None for anything else."""
    if module == PACKAGE or not module.startswith(PACKAGE + "."):
        return None
    path = PACKAGE_DIR / (module.removeprefix(PACKAGE + ".").replace(".", "/") + ".py")
    return path.read_text(encoding="utf-8") if path.is_file() else None


def forbidden_chains(
    root: str, read: Callable[[str], str | None] = _package_source
) -> list[list[str]]:
    """Import chains from ``root`` that reach a forbidden module.

    Follows the package's own modules (those ``read`` returns a source for)
    breadth first; each chain ends at the forbidden name.
    """
    chains: list[list[str]] = []
    seen = {root}
    queue: list[list[str]] = [[root]]
    while queue:
        chain = queue.pop(0)
        source = read(chain[-1])
        assert source is not None, chain
        for name, certain in _imports(source, chain[-1]):
            top = name.partition(".")[0]
            if top in FORBIDDEN or name in ("__import__", "importlib"):
                if certain:  # "from time import x" is reported once, as "time"
                    chains.append([*chain, name])
            elif name not in seen and read(name) is not None:
                seen.add(name)
                queue.append([*chain, name])
    return chains


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_reaches_no_io(module: str) -> None:
    assert forbidden_chains(f"{PACKAGE}.{module}") == []


def test_pure_modules_exist() -> None:
    # A renamed module would otherwise make its guard pass vacuously.
    for name in KNOWN_PURE:
        assert f"core.{name}" in PURE_MODULES, name
    for module in PURE_MODULES:
        assert (PACKAGE_DIR / f"{module.replace('.', '/')}.py").is_file(), module


# The settings package decides too (precedence, validation): it reads files
# but needs no Trio, sockets or clock, so it stays importable by a plain CLI.
SETTINGS_MODULES = sorted(
    f"cli.settings.{path.stem}" for path in (PACKAGE_DIR / "cli" / "settings").glob("*.py")
)


@pytest.mark.parametrize("module", SETTINGS_MODULES)
def test_settings_module_reaches_no_io(module: str) -> None:
    assert len(SETTINGS_MODULES) > 5  # the package, not a leftover module
    # "settings.__init__" as the name: its relative imports are then resolved
    # against the package itself.
    assert forbidden_chains(f"{PACKAGE}.{module}") == []


def test_the_core_package_init_imports_nothing() -> None:
    # Importing any core module runs core/__init__.py first.
    tree = ast.parse((PACKAGE_DIR / "core" / "__init__.py").read_text(encoding="utf-8"))
    assert list(_imports(ast.unparse(tree), f"{PACKAGE}.core.__init__")) == []


FAKE_PACKAGES = [
    pytest.param({"a": "import trio"}, [["a", "trio"]], id="direct"),
    pytest.param({"a": "import trio.lowlevel"}, [["a", "trio.lowlevel"]], id="submodule"),
    pytest.param({"a": "from time import monotonic"}, [["a", "time"]], id="from-import"),
    pytest.param({"a": "import socket as s"}, [["a", "socket"]], id="aliased"),
    pytest.param(
        {"a": "from .b import thing", "b": "import h11"},
        [["a", "b", "h11"]],
        id="transitive-relative",
    ),
    pytest.param(
        {"a": "from . import b", "b": "from trio_failover import c", "c": "import asyncio"},
        [["a", "b", "c", "asyncio"]],
        id="two-hops-module-imports",
    ),
    pytest.param(
        {"a": "import typing\nif typing.TYPE_CHECKING:\n    import trio_websocket"},
        [["a", "trio_websocket"]],
        id="type-checking-counts",
    ),
    pytest.param(
        {"a": "def f():\n    import trio\n    return trio"},
        [["a", "trio"]],
        id="inside-a-function",
    ),
    pytest.param({"a": "m = __import__('trio')"}, [["a", "__import__"]], id="dynamic"),
    pytest.param({"a": "import importlib"}, [["a", "importlib"]], id="importlib"),
    pytest.param({"a": "from .b import x", "b": "from .a import y"}, [], id="cycle-is-fine"),
    pytest.param(
        {"a": "import datetime, trio_failover_extra, timeit\nfrom .b import x", "b": "import re"},
        [],
        id="look-alike-names-are-fine",
    ),
]


@pytest.mark.parametrize(("sources", "chains"), FAKE_PACKAGES)
def test_forbidden_chains_finds_violations(
    sources: dict[str, str], chains: list[list[str]]
) -> None:
    full = {f"{PACKAGE}.{name}": text for name, text in sources.items()}
    found = forbidden_chains(f"{PACKAGE}.a", full.get)
    short = [[name.removeprefix(PACKAGE + ".") for name in chain] for chain in found]
    assert short == chains


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
# through one replaceable function"): the traces' epoch timestamps (SPEC 9).
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
