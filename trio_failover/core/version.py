"""The package's version, in a leaf that imports nothing.

Every layer reads it from here (``/status``, the metrics' build info, the
``User-Agent`` of the proxy's own requests, the traces' resource, ``--version``);
importing it from the package's ``__init__`` would make each of them depend on
everything the ``__init__`` re-exports. Kept equal to ``pyproject.toml``'s
``version`` (``tests/test_public_api.py`` checks it against the installed
metadata).
"""

from __future__ import annotations

__version__ = "0.1.0"
