"""Every ```python block of docs/embedding.md and docs/testing-kit.md runs.

Each block is a complete program, run in its own interpreter (a block binds
sockets and installs its own clock; a hung one is killed by the timeout).
After a block runs, the ``test_*`` functions it defines are run too, the way
pytest-trio would run them, so a test shown in the docs is a test that
passes. The MockClock example must take well under a second of real time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOCUMENTS = ("embedding.md", "testing-kit.md")
BLOCK_TIMEOUT = 60.0

# Run inside the child: the block, then its test functions, timed once the
# package is imported (the import is not what the docs promise is fast).
RUNNER = r"""
import functools, inspect, json, sys, time
import trio, trio.testing
import trio_failover, trio_failover.testing

path, name = sys.argv[1], sys.argv[2]
code = compile(open(path, encoding="utf-8").read(), name, "exec")
namespace = {"__name__": "__main__"}
started = time.perf_counter()
exec(code, namespace)
tests = []
for test_name, value in list(namespace.items()):
    if not test_name.startswith("test_") or not callable(value):
        continue
    if inspect.iscoroutinefunction(value):
        if "autojump_clock" in inspect.signature(value).parameters:
            clock = trio.testing.MockClock(autojump_threshold=0)
            trio.run(functools.partial(value, autojump_clock=clock), clock=clock)
        else:
            trio.run(value)
    else:
        value()
    tests.append(test_name)
print(json.dumps({"seconds": time.perf_counter() - started, "tests": tests}))
"""


@attrs.frozen
class Block:
    document: str
    line: int
    heading: str
    code: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"{self.document}:{self.line}:{slug}"


def python_blocks(document: str) -> list[Block]:
    """The ```python blocks of ``document``, with the heading above each."""
    blocks: list[Block] = []
    heading = ""
    code: list[str] | None = None
    start = 0
    lines = (DOCS / document).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if code is not None:
            if line.strip() == "```":
                blocks.append(Block(document, start, heading, "\n".join(code) + "\n"))
                code = None
            else:
                code.append(line)
        elif line.startswith("```python"):
            code, start = [], number
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    assert code is None, f"{document}: unterminated code block at line {start}"
    return blocks


ALL_BLOCKS = [block for document in DOCUMENTS for block in python_blocks(document)]


@attrs.frozen
class Run:
    seconds: float
    tests: list[str]
    stdout: str


def run_block(block: Block, tmp_path: Path) -> Run:
    source = tmp_path / "block.py"
    source.write_text(block.code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(source), block.id],
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
    )
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}\n{done.stderr}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Run(result["seconds"], result["tests"], done.stdout)


def test_the_documents_have_their_examples() -> None:
    embedding = [block for block in ALL_BLOCKS if block.document == "embedding.md"]
    assert len(embedding) >= 6
    assert any("MockClock(autojump_threshold=0)" in block.code for block in embedding)
    assert any("autojump_clock" in block.code for block in embedding)
    assert any(block.document == "testing-kit.md" for block in ALL_BLOCKS)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[block.id for block in ALL_BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    run = run_block(block, tmp_path)
    defined = re.findall(r"^async def (test_\w+)|^def (test_\w+)", block.code, re.MULTILINE)
    assert sorted(run.tests) == sorted(a or b for a, b in defined)


def test_mockclock_example_runs_in_virtual_time(tmp_path: Path) -> None:
    """The frozen + healthy example: 20 virtual seconds, whatever the machine's speed.

    How fast it runs is the benchmarks' business, not a test's: the printed
    clock proves the deadlines were virtual.
    """
    (block,) = [
        b
        for b in ALL_BLOCKS
        if b.document == "embedding.md" and "MockClock(autojump_threshold=0)" in b.code
    ]
    assert "frozen()" in block.code
    assert "first.at == 20.0" in block.code
    run = run_block(block, tmp_path)
    assert "virtual time: 20.0" in run.stdout
    print(f"the MockClock example took {run.seconds * 1000:.0f} ms of real time")


def test_cooldown_example_prints_what_its_comment_says(tmp_path: Path) -> None:
    """The ``open_proxy`` example's ready time, in its comment, is the one it prints.

    stuck gives no head by the 0.5 s response-header timeout and cools for
    one such timeout more: ready again at 1.0.
    """
    (block,) = [
        b for b in ALL_BLOCKS if b.document == "embedding.md" and '"ready again at"' in b.code
    ]
    said = re.search(r'"ready again at", trio\.current_time\(\)\)  # ([0-9.]+)$', block.code, re.M)
    assert said is not None, "the print line lost its comment"
    assert said.group(1) == "1.0"
    run = run_block(block, tmp_path)
    assert f"stuck ready again at {said.group(1)}\n" in run.stdout
