"""scripts/count_walks.py, which gives docs/architecture.md its walk counts, still runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "count_walks.py"


def test_count_walks_counts_both_walks() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=True
    )
    lines = result.stdout.splitlines()
    heads = [line for line in lines if not line.startswith("  ")]
    assert [head.partition(":")[0] for head in heads] == ["request", "commit"]
    files = [line.strip() for line in lines if line.startswith("  ")]
    # The request walks from the proxy's entry through all layers it uses...
    assert files[0] == "proxy/proxy.py"
    assert {"wire/client.py", "proxy/request/workload.py", "core/outcome.py"} <= set(files)
    # ...and the commit walk begins at the milestone that records it.
    commit = lines.index(heads[1])
    assert lines[commit + 1] == "  proxy/request/milestones.py"
    assert not [file for file in files if file.startswith("testing/")]  # the other ends
