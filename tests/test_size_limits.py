"""The package's sizes, as a report: the largest functions, classes and modules.

Size is a smell detector, not a rule: a 600-line module that is one idea
beats three of 200 that reach into each other. So nothing here fails for a
size. ``test_size_report`` prints (``pytest -s``, or ``-rA``) every function
over 100 lines, class over 200 and module over 450, and the ten largest of
each kind, for a reviewer to look at; the measure itself is tested.

Counted by ``ast`` from the ``def`` or ``class`` line to the last line of
the body (docstring and comments inside included; decorators not); a
module by all its lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trio_failover"
# Where a reviewer looks twice: not limits.
LOOK_AT_FUNCTION = 100
LOOK_AT_CLASS = 200
LOOK_AT_MODULE = 450
SHOWN = 10


def sizes(source: str, where: str) -> list[tuple[str, str, int]]:
    """``(kind, where:name, lines)`` of the module and of every function and class in it."""
    lines = source.count("\n") + (not source.endswith("\n") and bool(source))
    found = [("module", where, lines)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            found.append((kind, f"{where}:{node.name}", length))
    return found


def report(measured: list[tuple[str, str, int]]) -> list[str]:
    """The report's lines: per kind, the ones over the look-at size, then the largest."""
    lines = []
    looks = {"function": LOOK_AT_FUNCTION, "class": LOOK_AT_CLASS, "module": LOOK_AT_MODULE}
    for kind, look_at in looks.items():
        of_kind = sorted((m for m in measured if m[0] == kind), key=lambda m: -m[2])
        over = [m for m in of_kind if m[2] > look_at]
        plural = "classes" if kind == "class" else kind + "s"
        lines.append(f"{plural} over {look_at} lines: {len(over)}")
        lines += [f"  {name} {length}" for _, name, length in of_kind[: max(SHOWN, len(over))]]
    return lines


def test_size_report() -> None:
    measured = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        measured += sizes(path.read_text(encoding="utf-8"), where)
    lines = report(measured)
    print("\n".join(lines))
    assert any(line.startswith("modules over") for line in lines)


def test_the_measure_sees_each_kind() -> None:
    long_function = "def f():\n" + "    x = 1\n" * LOOK_AT_FUNCTION
    long_method = "class C:\n    async def g(self):\n" + "        pass\n" * LOOK_AT_FUNCTION
    assert ("function", "m.py:f", 101) in sizes(long_function, "m.py")
    assert ("function", "m.py:g", 101) in sizes(long_method, "m.py")
    assert ("class", "m.py:C", 102) in sizes(long_method, "m.py")
    assert sizes("x = 1\n" * 451, "m.py") == [("module", "m.py", 451)]
    assert sizes("x = 1", "m.py") == [("module", "m.py", 1)]


def test_the_report_lists_what_is_over_and_the_largest() -> None:
    measured = [("module", f"m{n}.py", 440 + n) for n in range(20)]
    lines = report(measured)
    modules = lines[lines.index("modules over 450 lines: 9") + 1 :]
    assert len(modules) == 10  # the nine over, and the largest ten in all
    assert modules[0] == "  m19.py 459"
