"""The docs and the package stand alone: they cite no contract document.

The project was built to a contract that does not ship with it, so "see
SPEC 5c" sends a reader nowhere. What a user reads (README.md, docs/, the
deploy files and examples) and what ships in the package (its comments,
docstrings, help and log texts, the dashboard page) say the rule where they
use it, or link our own docs page. This test finds the uppercase word
``SPEC`` in any of them (``SPEC 5.5``, ``SPEC section 6``, ``SPEC.md``,
``SPEC's key``), and a link to a heading that still carries such a number
(``#engine-kinds-and-their-signals-spec-5c``).

CHANGELOG.md is history and is not read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Text a user reads or the package ships; binary files (dashboard.png) are skipped.
SOURCES = ("README.md", "docs", "trio_failover", "deploy", "examples")
CITATION = re.compile(r"\bSPEC\b")  # case-sensitive: "INSPECT", "spec" (a word) are fine
SPEC_ANCHOR = re.compile(r"#[\w-]*-spec-\d", re.IGNORECASE)


def shipped_texts() -> list[Path]:
    files: list[Path] = []
    for name in SOURCES:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in candidates:
            if file.is_file() and "__pycache__" not in file.parts:
                try:
                    file.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    continue  # an image
                files.append(file)
    return files


def citations(text: str) -> list[str]:
    """Each line of ``text`` that cites the contract document, as ``N: line``."""
    return [
        f"{number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), start=1)
        if CITATION.search(line) or SPEC_ANCHOR.search(line)
    ]


@pytest.mark.parametrize(
    ("line", "cites"),
    [
        ("the checks (SPEC 5a) ask /health", True),
        ("Two types (SPEC section 6):", True),
        ("the contract is in SPEC.md", True),
        ("as SPEC's key says", True),
        ("[engines](engines.md#engine-kinds-and-their-signals-spec-5c)", True),
        ("HeadAction.INSPECT", False),
        ("a specific spec of the node", False),
        ("[engines](engines.md#engine-kinds-and-their-signals)", False),
    ],
)
def test_what_counts_as_a_citation(line: str, cites: bool) -> None:
    assert bool(citations(line)) is cites


def test_the_sources_are_read() -> None:
    names = {file.relative_to(ROOT).as_posix() for file in shipped_texts()}
    assert {"README.md", "docs/engines.md", "trio_failover/core/engines.py"} <= names
    assert "trio_failover/service/dashboard.html" in names


def test_no_contract_citations() -> None:
    found = [
        f"{file.relative_to(ROOT)}:{hit}"
        for file in shipped_texts()
        for hit in citations(file.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "these cite a document users do not have; say the rule or link our docs page:\n"
        + "\n".join(found)
    )
