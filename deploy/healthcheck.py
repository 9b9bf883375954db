"""The container's health check: exit 0 when the admin listener's ``/healthz`` answers 200.

The image's ``HEALTHCHECK`` runs it inside the container (``Dockerfile``,
docs/deploying.md). It asks the address in ``TRIO_FAILOVER_ADMIN_LISTEN``
(the image sets ``127.0.0.1:8081``), a wildcard host (``0.0.0.0``, ``::``)
on loopback. Exit 1, with the reason on stderr, for anything else: no
answer, ``503`` (a drain has begun), or the admin listener ``off``.
The standard library only: it runs with the image's Python and nothing else.
"""

from __future__ import annotations

import os
import sys
import urllib.request

DEFAULT = "127.0.0.1:8081"
# Within the container's own --timeout (3s): an answer later than this is a failure.
TIMEOUT = 2.0
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def healthz_url(listen: str) -> str:
    """The ``/healthz`` URL of an admin listener's ``HOST:PORT`` (``[v6]:PORT`` too).

    Raises:
        ValueError: ``listen`` is not ``HOST:PORT``.
    """
    host, colon, port = listen.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"TRIO_FAILOVER_ADMIN_LISTEN={listen!r} is not HOST:PORT")
    host = host.removeprefix("[").removesuffix("]")
    host = WILDCARDS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def main() -> int:
    listen = os.environ.get("TRIO_FAILOVER_ADMIN_LISTEN", DEFAULT)
    if listen.lower() in {"off", "false"}:
        print("the admin listener is off: nothing answers /healthz", file=sys.stderr)
        return 1
    # No proxy from the environment: the question is for this container's loopback.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        url = healthz_url(listen)
        with opener.open(url, timeout=TIMEOUT) as response:
            status = response.status
    except (OSError, ValueError) as exc:  # HTTPError (503 draining) is an OSError too
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
