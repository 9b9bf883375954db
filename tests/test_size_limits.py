"""The package's size limits: no function over 100 lines, class over 200, module over 450.

Counted by ``ast`` from the ``def`` or ``class`` line to the last line of
the body (docstring and comments inside included; decorators not); a
module by all its lines. New modules are checked without being listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trio_failover"
MAX_FUNCTION = 100
MAX_CLASS = 200
MAX_MODULE = 450


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def oversized(source: str, where: str) -> list[str]:
    """Every function, class and the module itself over its limit, as ``where:name lines``."""
    found = []
    lines = source.count("\n") + (not source.endswith("\n") and bool(source))
    if lines > MAX_MODULE:
        found.append(f"{where}: module {lines} lines > {MAX_MODULE}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append(f"{where}:{node.name} {length} lines > {limit}")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda path: path.relative_to(PACKAGE).as_posix())
def test_within_the_size_limits(path: Path) -> None:
    where = path.relative_to(PACKAGE).as_posix()
    assert oversized(path.read_text(encoding="utf-8"), where) == []


def test_the_check_sees_each_kind_of_excess() -> None:
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION
    long_method = "class C:\n    async def g(self):\n" + "        pass\n" * MAX_FUNCTION
    long_class = "class D:\n" + "    x = 1\n" * MAX_CLASS
    assert oversized(long_function, "m.py") == ["m.py:f 101 lines > 100"]
    assert oversized(long_method, "m.py") == ["m.py:g 101 lines > 100"]
    assert oversized(long_class, "m.py") == ["m.py:D 201 lines > 200"]
    assert oversized("x = 1\n" * (MAX_MODULE + 1), "m.py") == ["m.py: module 451 lines > 450"]
    assert oversized("x = 1\n" * MAX_MODULE, "m.py") == []
    assert oversized("def f():\n" + "    x = 1\n" * (MAX_FUNCTION - 1), "m.py") == []
