"""``python -m trio_failover``: the same as the ``trio-failover`` command."""

from __future__ import annotations

from .cli.cli import main

if __name__ == "__main__":
    main()
