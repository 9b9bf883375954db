"""``check --admin URL``: what a reload of a running proxy to these settings would change.

The running proxy answers ``GET /config`` (``service/admin.py``) with its
settings, every secret an HMAC under a salt fresh for that answer; the
settings ``check`` resolved are masked with the same salt and the two are
compared by ``core/reload.py``'s ``diff_configs``, as a reload would. So a
rotated key shows as rotated, and no secret crosses the wire. The TLS files
are compared by path: a certificate renewed in place shows only when the
proxy reloads (it reads the files then).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from ..core.config import Config
from ..core.errors import ConfigError
from ..core.reload import config_from_document, diff_configs, hmac_mask, masked

__all__ = ["compare_with_running"]

EXIT_UNREACHABLE = 1
"""The admin listener could not be asked, or gave no configuration."""
EXIT_REFUSED = 2
"""A reload to these settings would be refused (it needs a restart)."""
TIMEOUT = 10.0


def compare_with_running(config: Config, admin_url: str, echo: Callable[[str], None]) -> int:
    """Print what reloading the proxy at ``admin_url`` to ``config`` would change; exit status."""
    try:
        answer = _fetch(admin_url.rstrip("/") + "/config", config.admin_token)
        running = config_from_document(answer["config"])
        mask = hmac_mask(bytes.fromhex(answer["salt"]))
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        print(
            f"trio-failover: error: --admin {admin_url}: cannot read its configuration ({exc})",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    diff = diff_configs(running, masked(config, mask))
    echo("")
    if not diff.ok:
        echo(f"a reload of {admin_url} would be refused:")
        for reason in diff.refused:
            echo(f"  {reason}")
        return EXIT_REFUSED
    changes = diff.changes()
    echo(
        f"a reload of {admin_url} would change:"
        if changes
        else f"a reload of {admin_url} would change nothing"
    )
    for change in changes:
        echo(f"  {change}")
    return 0


def _fetch(url: str, token: str | None) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(f"HTTP {exc.code}") from None
