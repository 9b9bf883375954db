"""The report `make e2e` writes: figures per scenario, outcomes, versions."""

from __future__ import annotations

import datetime
import json
import os
import statistics
from pathlib import Path
from typing import Any, ClassVar

import pytest


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1) if values else float("nan")


class Report:
    """Figures recorded by the tests (never asserted here), written at the end."""

    _outcomes: ClassVar[dict[str, str]] = {}

    def __init__(self, versions: dict[str, str]):
        self.versions = versions
        self.rows: list[dict[str, Any]] = []

    @classmethod
    def outcomes_seen(cls, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            outcome = "xfail" if hasattr(report, "wasxfail") else report.outcome
            if report.nodeid not in cls._outcomes or outcome != "passed":
                cls._outcomes[report.nodeid] = outcome

    def record(self, scenario: str, engine: str, **figures: Any) -> None:
        self.rows.append({"scenario": scenario, "engine": engine, **figures})

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        data = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cpus": os.cpu_count(),
            "versions": self.versions,
            "figures": self.rows,
            "outcomes": dict(sorted(self._outcomes.items())),
        }
        (folder / "report.json").write_text(json.dumps(data, indent=2) + "\n")
        (folder / "report.md").write_text(markdown(data))


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"End-to-end run of {data['date']} on {data['cpus']} CPUs, one thread per engine.",
        "",
        "| component | version |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value} |" for name, value in data["versions"].items()]
    lines += ["", "| scenario | engine | figures (ms unless named) |", "|---|---|---|"]
    for row in data["figures"]:
        figures = ", ".join(
            f"{key} {value}" for key, value in row.items() if key not in ("scenario", "engine")
        )
        lines.append(f"| {row['scenario']} | {row['engine']} | {figures} |")
    lines += ["", "| test | outcome |", "|---|---|"]
    lines += [f"| `{test}` | {outcome} |" for test, outcome in data["outcomes"].items()]
    return "\n".join(lines) + "\n"
