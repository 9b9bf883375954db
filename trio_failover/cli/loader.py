"""How a serving process reads its settings again, for a reload (docs/configuration.md).

``serve`` resolves the flags, environment and config file once at startup;
a ``SettingsLoader`` keeps the flags it was given, so that ``SIGHUP`` and
``--watch-config`` read the environment and the file again with the same
precedence, and the same checks and error lines, as at startup. It is a
plain value: ``reexec`` hands it to the fresh process image with the
``Config``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from ..core.config import Config
from ..core.errors import ConfigError
from .settings import Source, place, resolve

__all__ = ["SettingsLoader"]


@attrs.frozen
class SettingsLoader:
    """The flags ``serve`` was given, and the config file they and the environment named."""

    flags: Mapping[str, Any]
    path: str | None = None
    """The config file (``--config`` or its variable), the one ``--watch-config`` watches."""
    sources: Mapping[str, Source] = attrs.field(factory=dict)
    """Where each value of the startup settings came from, for ``placed``."""

    def __call__(self) -> Config:
        """The settings as they read now.

        Raises:
            ConfigError: one mistake, or ``ConfigErrors`` with all of them.
        """
        config, _ = resolve(dict(self.flags), os.environ)
        return config

    def placed(self, error: ConfigError) -> ConfigError:
        """``error`` from serving (an address that cannot be bound), naming the value's source."""
        return place(error, self.sources)
