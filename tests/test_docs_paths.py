"""The documentation names modules, signatures and routes that exist.

Modules move between merges (``trio_failover/logs.py`` became
``service/logs.py``); a page that still names the old place sends a reader
to nothing. These checks cover what docs/*.md and README.md name in the
package:

1. every path of a package module (``core/headers.py``,
   ``trio_failover/service/server.py``) is a file of the package;
2. every dotted name with a module and an attribute below the package
   (``trio_failover.service.logs.configure_logging``) imports and resolves
   (a name one level deep, ``trio_failover.outcome``, is a span attribute
   or a logger as often as a module, and is not checked);
3. embedding.md's line for ``serve()`` lists its parameters, in order;
4. configuration.md's ``--admin-listen`` row names every admin route.

CHANGELOG.md is history: it names the old places on purpose.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from trio_failover import serve

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trio_failover"
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
LAYERS = ("core", "wire", "proxy", "service", "telemetry", "cli", "testing", "demo")

MODULE_PATH = re.compile(
    rf"(?<![\w./-])((?:trio_failover/)?(?:{'|'.join(LAYERS)})/[\w/]+\.py|trio_failover/\w+\.py)"
)
DOTTED = re.compile(r"(?<![\w.])trio_failover(?:\.\w+){2,}")


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(0)))
    return found


def test_every_module_path_in_the_docs_is_a_file() -> None:
    missing = []
    for where, path in _mentions(MODULE_PATH):
        relative = path.removeprefix("trio_failover/")
        if not (PACKAGE / relative).is_file():
            missing.append(f"{where}: {path}")
    assert missing == []


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_every_dotted_name_in_the_docs_resolves() -> None:
    unknown = [f"{where}: {name}" for where, name in _mentions(DOTTED) if not _resolves(name)]
    assert unknown == []


def test_embedding_names_every_parameter_of_serve() -> None:
    text = (ROOT / "docs" / "embedding.md").read_text(encoding="utf-8")
    [line] = [row for row in text.splitlines() if row.startswith("| `serve(")]
    listed = re.match(r"\| `serve\(([^)]*)\)`", line)
    assert listed is not None
    names = [part.strip().split("=")[0] for part in listed.group(1).split(",")]
    assert [name for name in names if name != "*"] == list(inspect.signature(serve).parameters)


@pytest.fixture(scope="module")
def admin_routes() -> set[str]:
    source = (PACKAGE / "service" / "admin.py").read_text(encoding="utf-8")
    return set(re.findall(r'b"(/[a-z]*)"', source))


def test_admin_listen_names_every_admin_route(admin_routes: set[str]) -> None:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    [row] = [line for line in text.splitlines() if line.startswith("| `--admin-listen ")]
    named = set(re.findall(r"`(/[a-z]*)`", row))
    assert admin_routes >= {"/healthz", "/status", "/metrics", "/events", "/history", "/"}
    assert admin_routes - named == set()
