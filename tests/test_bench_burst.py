"""``scripts/bench_burst.py`` runs end to end on a tiny burst (the timings are not tested).

The script is a measurement tool that CI does not run; this keeps it from
rotting: with capacity, configured or ``auto`` from fake llama-servers, both
fake engines serve; without it the first takes everything; nothing fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_burst.py"


def test_a_tiny_burst_spreads_with_capacity_and_piles_up_without() -> None:
    options = ["--requests", "6", "--nodes", "2", "--slots", "1", "--service-ms", "20"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("burst: 6 requests at once, 2 nodes x 1 slots, 20 ms each")
    with_capacity, auto, without = lines[1:4]
    assert "--capacity 1 " in with_capacity
    assert "--capacity auto " in auto
    for line in (with_capacity, auto):
        assert "x ideal" in line
        assert "failed 0" in line
        spread = dict(re.findall(r"(n\d)=(\d+)", line))
        assert set(spread) == {"n1", "n2"}, line
        assert sum(map(int, spread.values())) == 6
    assert "--capacity 0 " in without
    assert "served n1=6 " in without
    assert "failed 0" in without


def test_runs_picks_some_and_refuses_others() -> None:
    options = ["--requests", "2", "--nodes", "2", "--slots", "1", "--service-ms", "5"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *options, "--runs", "auto"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert [line.split()[1] for line in result.stdout.splitlines()[1:]] == ["auto"]
    refused = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "auto,5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 2
    assert "--runs" in refused.stderr
