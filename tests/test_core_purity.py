"""The modules of trio_failover.core use only the standard library, and no I/O or clock.

Checked on the source with ``ast`` (importing would prove nothing about one
module). A shell author may import them from anywhere: they import nothing
of the package outside ``core``, so a restructured package cannot pull Trio
in behind them. import-linter's contracts (pyproject.toml) forbid the I/O
modules by name, across the whole import graph; what they cannot say is
"the standard library and attrs only" and "no ``__import__``": that is here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "trio_failover" / "core"
# "" (a relative import out of core) is not a standard module either.
FORBIDDEN = frozenset({"trio", "h11", "socket", "time", "asyncio", "selectors", "ssl", "threading"})
MODULES = sorted(path.stem for path in CORE.glob("*.py"))
# attrs makes frozen data classes and does no I/O: config.py, cooldown.py and
# outcome.py, moved into core/ by the layering, are built on it.
PURE_LIBRARIES = frozenset({"attrs"})


def offending_imports(source: str) -> list[str]:
    """Imports that are neither allowed standard library nor ``core``'s own modules."""
    bad: list[str] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                continue  # from .x import y: a sibling in core
            names = ["." * node.level + (node.module or "")]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names = ["__import__"]
        for name in names:
            top = name.partition(".")[0]
            allowed = top in sys.stdlib_module_names or top in PURE_LIBRARIES
            if top in FORBIDDEN or top == "importlib" or not allowed:
                bad.append(name)
    return bad


def test_core_has_the_modules_others_import() -> None:
    assert {"inventory", "sse", "requests", "answers", "auth"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_core_module_imports_only_the_standard_library(module: str) -> None:
    assert offending_imports((CORE / f"{module}.py").read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("import trio", ["trio"]),
        ("from time import monotonic", ["time"]),
        ("import attrs", []),
        ("import prometheus_client", ["prometheus_client"]),
        ("from .. import config", [".."]),
        ("from ..ranking import x", ["..ranking"]),
        ("m = __import__('trio')", ["__import__"]),
        ("import importlib", ["importlib"]),
        ("import json, re\nfrom .sse import SseScanner\nfrom collections.abc import Mapping", []),
    ],
)
def test_offending_imports_finds_violations(source: str, bad: list[str]) -> None:
    assert offending_imports(source) == bad
