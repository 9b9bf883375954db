"""The documentation stays true to the tree and to the command line.

1. Every relative link in README.md and docs/*.md points to a file (or
   directory) inside the repository, and a ``#fragment`` names a heading of
   the Markdown file it points to (GitHub's anchor rules).
2. Every ``--flag`` the docs give for trio-failover is a real option: one of
   ``settings.OPTIONS`` or the few flags the CLI adds itself.

Flags of other programs (curl, vllm, nc...) must not count, so a flag is
checked only where the docs clearly speak of trio-failover:

- an inline code span that starts with the flag (`` `--listen HOST:PORT` ``);
- an inline code span that starts with ``trio-failover``;
- a command in a fenced code block whose program is ``trio-failover`` (after
  an optional ``$`` prompt and ``VAR=value`` assignments; continuation lines
  joined; each part of a pipeline judged on its own). A block marked
  ``text`` holds output, not commands, and is not read for flags (a
  benchmark report starts its lines with the program's name too).

Links and flags inside code are found by the same small Markdown reader;
links in code spans or fenced blocks are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from trio_failover.cli.settings import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

# Flags that cli.py defines outside the option table: `--version` on the
# program, `--once` on `demo`, and click's own `--help`.
CLI_ONLY_FLAGS = frozenset({"--version", "--help", "--once", "--admin"})  # --admin: check only
KNOWN_FLAGS = frozenset(option.flag for option in OPTIONS) | CLI_ONLY_FLAGS
PROGRAM = "trio-failover"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*(\S*)")
OUTPUT_BLOCKS = {"text"}  # info strings of fenced blocks that show output
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
_INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][A-Za-z0-9-]*)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
_PIPELINE = re.compile(r"\s(?:\|\||&&|\||;)\s")


# -- a small Markdown reader ----------------------------------------------------------------------


def split_blocks(text: str) -> tuple[list[str], list[list[str]]]:
    """The prose lines (fenced blocks blanked out) and the lines of the fenced
    blocks that may hold commands (a block marked as output is left out)."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    fence: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                lines = []
                if match.group(2) not in OUTPUT_BLOCKS:
                    blocks.append(lines)
                prose.append("")
            else:
                prose.append(line)
        else:
            # A fence closes with the same character, at least as long, nothing after.
            marks = match.group(1) if match else ""
            if marks[:1] == fence[:1] and len(marks) >= len(fence) and not line.strip(" `~"):
                fence = None
            else:
                lines.append(line)
            prose.append("")
    return prose, blocks


def code_spans(line: str) -> list[str]:
    """The contents of the inline code spans of one line."""
    return [match.group(2).strip() for match in _CODE_SPAN.finditer(line)]


def without_code_spans(line: str) -> str:
    return _CODE_SPAN.sub(lambda match: " " * len(match.group(0)), line)


def link_targets(text: str) -> list[str]:
    """Targets of inline links, images and reference definitions outside code."""
    prose, _ = split_blocks(text)
    targets: list[str] = []
    for line in prose:
        line = without_code_spans(line)
        targets += [match.group(1) for match in _INLINE_LINK.finditer(line)]
        reference = _REFERENCE.match(line)
        if reference:
            targets.append(reference.group(1))
    return targets


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file offers: headings (with -1, -2 for repeats), <a id>."""
    prose, _ = split_blocks(text)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose:
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _commands(lines: list[str]) -> list[str]:
    """Shell commands of a fenced block, continuation lines joined."""
    commands: list[str] = []
    current = ""
    for line in lines:
        stripped = line.strip()
        if current:
            current += " " + stripped
        else:
            current = stripped
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        commands.append(current)
        current = ""
    if current:
        commands.append(current)
    return commands


def _runs_program(command: str) -> bool:
    words = command.split()
    if words[:1] == ["$"]:
        words = words[1:]
    while words and _ASSIGNMENT.match(words[0]):
        words = words[1:]
    return words[:1] == [PROGRAM]


def proxy_flags(text: str) -> set[str]:
    """The ``--flags`` a Markdown text gives for trio-failover (see the module docstring)."""
    prose, blocks = split_blocks(text)
    flags: set[str] = set()
    for line in prose:
        for span in code_spans(line):
            if span.startswith("--") or span.split()[:1] == [PROGRAM]:
                flags.update(_FLAG.findall(span))
    for block in blocks:
        for command in _commands(block):
            for part in _PIPELINE.split(command):
                if _runs_program(part):
                    flags.update(_FLAG.findall(part))
    return flags


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Why each relative link of ``path`` is broken (empty when all are fine)."""
    text = path.read_text(encoding="utf-8")
    problems: list[str] = []
    for target in link_targets(text):
        if not target or _SCHEME.match(target) or target.startswith("//"):
            continue  # a URL (https:, mailto:...), not a file of this tree
        file_part, _, fragment = target.partition("#")
        destination = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not destination.is_relative_to(root):
            problems.append(f"{target}: points outside the repository")
        elif not destination.exists():
            problems.append(f"{target}: no such file")
        elif fragment and destination.suffix == ".md" and destination.is_file():
            offered = anchors(destination.read_text(encoding="utf-8"))
            if unquote(fragment).lower() not in offered:
                problems.append(f"{target}: no heading #{fragment} in {destination.name}")
    return problems


# -- the reader itself, on made-up text ------------------------------------------------------------


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        pytest.param("Set `--first-body-timeout 10s`.", {"--first-body-timeout"}, id="flag-span"),
        pytest.param("`--tls-cert PATH` / `--tls-key PATH`", {"--tls-cert", "--tls-key"}, id="two"),
        pytest.param("`--no-such-option`", {"--no-such-option"}, id="unknown-is-found"),
        pytest.param("`trio-failover check --config f.toml`", {"--config"}, id="program-span"),
        pytest.param("`curl -N --no-buffer URL`", set(), id="curl-span"),
        pytest.param("`vllm serve M --host 0.0.0.0`", set(), id="vllm-span"),
        pytest.param("plain --listen in prose", set(), id="prose"),
        pytest.param(
            "```sh\n$ GPU_KEY=x trio-failover serve \\\n  --listen 0.0.0.0:8080 \\\n"
            "  --upstream a=http://h:1\n```",
            {"--listen", "--upstream"},
            id="fenced-continued",
        ),
        pytest.param("```sh\ncurl --cacert ca.pem https://h/\n```", set(), id="fenced-curl"),
        pytest.param(
            "```sh\ntrio-failover check --config f | grep --color x\n```",
            {"--config"},
            id="pipeline",
        ),
        pytest.param("```text\nt=120  one --response-header-timeout\n```", set(), id="timeline"),
        pytest.param(
            "```text\ntrio-failover 0.1.0 benchmark; command: bench.py --only json\n```",
            set(),
            id="output-block",
        ),
        pytest.param("```\ntrio-failover serve --listen :1\n```", {"--listen"}, id="plain-fence"),
    ],
)
def test_proxy_flags_reader(markdown: str, expected: set[str]) -> None:
    assert proxy_flags(markdown) == expected


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        pytest.param("[a](b.md) and ![i](d.png)", ["b.md", "d.png"], id="inline"),
        pytest.param('[a](b.md#x "title")', ["b.md#x"], id="title"),
        pytest.param("[`--flag`](c.md#y)", ["c.md#y"], id="code-in-text"),
        pytest.param("`[a](b.md)` and\n```\n[c](d.md)\n```", [], id="in-code"),
        pytest.param("[ref]: other.md#z", ["other.md#z"], id="reference"),
    ],
)
def test_link_reader(markdown: str, expected: list[str]) -> None:
    assert link_targets(markdown) == expected


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("## Reading `/status`", "reading-status"),
        ("### 2. Headers, then silence", "2-headers-then-silence"),
        ("### `--response-header-timeout`", "--response-header-timeout"),
        ("## What fails over, what cools down", "what-fails-over-what-cools-down"),
    ],
)
def test_heading_anchors(heading: str, anchor: str) -> None:
    assert anchor in anchors(heading)


def test_repeated_headings_get_numbered_anchors() -> None:
    assert anchors("# Notes\n## Notes\n### Notes") == {"notes", "notes-1", "notes-2"}


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# Here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#here) [gone](missing.md) [bad](there.md#nowhere) "
        "[self](#top) [web](https://example.com/x.md) [out](../x.md)\n# Top\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "missing.md: no such file",
        "there.md#nowhere: no heading #nowhere in there.md",
        "../x.md: points outside the repository",
    ]


# -- the real documents -------------------------------------------------------------------------


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", DOC_FILES, ids=_doc_id)
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOC_FILES, ids=_doc_id)
def test_flags_are_real_options(path: Path) -> None:
    flags = proxy_flags(path.read_text(encoding="utf-8"))
    assert sorted(flags - KNOWN_FLAGS) == []


def test_the_docs_mention_the_failover_flags() -> None:
    # Guards the reader against silently finding nothing in the real docs.
    failover = proxy_flags((ROOT / "docs" / "failover.md").read_text(encoding="utf-8"))
    assert {"--response-header-timeout", "--first-body-timeout", "--client-close"} <= failover
