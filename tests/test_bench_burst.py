"""``scripts/bench_burst.py`` runs end to end on a tiny burst (the timings are not tested).

The script is a measurement tool that CI does not run; this keeps it from
rotting: with capacity both fake engines serve, without it the first takes
everything, and nothing fails.
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
    with_capacity, without = lines[1], lines[2]
    assert "--capacity 1 " in with_capacity
    assert "x ideal" in with_capacity
    assert "failed 0" in with_capacity
    spread = dict(re.findall(r"(n\d)=(\d+)", with_capacity))
    assert set(spread) == {"n1", "n2"}
    assert sum(map(int, spread.values())) == 6
    assert "--capacity 0 " in without
    assert "served n1=6 " in without
    assert "failed 0" in without
