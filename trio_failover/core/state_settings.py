"""Pure: the settings of the replicas' shared state, a base of ``Config``.

``Config`` (core/config.py) inherits these five fields, so that they are
``Config``'s own (``attrs.fields``, ``evolve``, the option table) while
their checks live next to each other here: ``--state``, ``--state-prefix``,
``--lease-ttl``, ``--state-timeout`` and ``--workers``.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from .errors import ConfigError
from .redis_url import MEMORY, masked_url, parse_state

__all__ = ["StateSettings"]

# Visible ASCII: the prefix starts every key and channel name and shows in
# logs; a blank in it would be a mistake nobody sees.
_PREFIX_RE = re.compile(r"[\x21-\x7e]{1,100}")


def _check_state(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    try:
        if not isinstance(value, str):
            raise ValueError("expected memory or a redis:// URL")
        parse_state(value)
    except ValueError as exc:
        shown = masked_url(value) if isinstance(value, str) else value
        raise ConfigError(attribute.name, shown, str(exc)) from None


def _check_prefix(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not _PREFIX_RE.fullmatch(value):
        raise ConfigError(attribute.name, value, "1 to 100 visible ASCII characters, no blanks")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ConfigError(attribute.name, value, "must be greater than zero")


@attrs.frozen(kw_only=True)
class StateSettings:
    """Where the replicas' shared state is, and its bounds (docs/replicas.md)."""

    state: str = attrs.field(
        default=MEMORY, validator=_check_state, repr=lambda url: repr(masked_url(url))
    )
    """``memory`` (this process alone) or a ``redis://`` / ``rediss://`` URL."""
    state_prefix: str = attrs.field(default="trio-failover:", validator=_check_prefix)
    """Starts every key and channel name, so that several fleets share one Redis."""
    lease_ttl: float = attrs.field(default=30.0, validator=_positive)
    """Seconds a slot's lease lasts unless its attempt renews it."""
    state_timeout: float = attrs.field(default=0.25, validator=_positive)
    """The longest a request waits on the shared state (the slot take)."""
    workers: int = attrs.field(default=1, validator=_positive)
    """Processes sharing the listeners; more than 1 needs a shared ``state``."""

    def __attrs_post_init__(self) -> None:
        # More than one worker with each counting only its own attempts would
        # break every capacity: refuse it before anything listens.
        if self.workers > 1 and self.state.strip() == MEMORY:
            raise ConfigError(
                "workers",
                self.workers,
                "more than one worker needs a shared state (--state redis://HOST:PORT); "
                "with --state memory each worker would count only its own attempts",
            )
