"""One writer of the workload record: its fields change only through its own verbs.

As a node's state changes only through the board's verbs, a ``Workload``'s
fields are assigned only in ``proxy/records.py`` (its verbs); the shell
calls them, and Report, the traces, events and metrics only read. This
test reads the package's source and fails on any assignment to a
workload's field, or an append to its attempts, anywhere else.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attrs

from trio_failover.proxy.records import Workload

PACKAGE = Path(__file__).resolve().parent.parent / "trio_failover"
OWNER = "proxy/records.py"
FIELDS = {field.name.lstrip("_") for field in attrs.fields(Workload)} | {"state"}
NAMES = {"work", "workload"}  # what the shell calls a workload


def writes(source: str, where: str) -> list[str]:
    """Every assignment to a workload's field in ``source`` (``where:line field``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend", "clear")
        ):
            targets = [node.func.value]
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and part.attr in FIELDS
                    and isinstance(part.value, ast.Name)
                    and part.value.id in NAMES
                ):
                    found.append(f"{where}:{part.lineno} {part.attr}")
    return found


def test_only_the_record_writes_a_workload() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where != OWNER:
            found += writes(path.read_text(encoding="utf-8"), where)
    assert found == []


def test_the_check_sees_each_kind_of_write() -> None:
    source = (
        "work.status = 200\n"
        "work.body_bytes += 3\n"
        "work.node, work.attempt = 'a', 1\n"
        "work.attempts.append(record)\n"
        "self.status = 1\n"  # a record of its own: not a workload's
        "work.sent(3)\n"
    )
    assert writes(source, "m.py") == [
        "m.py:1 status",
        "m.py:2 body_bytes",
        "m.py:3 node",
        "m.py:3 attempt",
        "m.py:4 attempts",
    ]
