"""No module of the package imports another module's private names (``from .x import _y``).

A name with a leading underscore is its module's own business; what other
modules need gets a public name (``upstream.connect_node``, not
``upstream._connect``). Importing a public name *as* a private alias is fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trio_failover"


def private_imports(source: str) -> list[str]:
    """The private names ``source`` imports from the package (relative or absolute)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0 and not (node.module or "").startswith("trio_failover"):
            continue  # another library's business
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{'.' * node.level}{node.module or ''} import {alias.name}")
    return found


def test_no_module_imports_a_private_name() -> None:
    found = {
        path.relative_to(PACKAGE).as_posix(): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if (names := private_imports(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_the_check_sees_private_imports() -> None:
    assert private_imports("from .upstream import _connect") == [".upstream import _connect"]
    assert private_imports("from ..wire.fakes import ok, _chunk") == ["..wire.fakes import _chunk"]
    assert private_imports("from trio_failover.x import _y") == ["trio_failover.x import _y"]
    assert private_imports("from .upstream_errors import map_error as _map_error") == []
    assert private_imports("from typing import _T") == []
    assert private_imports("from . import __version__") == []
