"""Pure: the shared state's settings, and its address, ``redis://[USER:PASS@]HOST:PORT[/DB]``.

``StateSettings``, a base of ``Config``: ``Config`` (core/config.py)
inherits its five fields, so that they are ``Config``'s own
(``attrs.fields``, ``evolve``, the option table) while their checks live
next to each other here: ``--state``, ``--state-prefix``, ``--lease-ttl``,
``--state-timeout`` and ``--workers``.

``rediss://`` is the same over TLS. The parser raises ``ValueError`` whose
message says what was expected, as ``units.py`` does; ``cli/settings/`` will
add the option name (``--state``) and the source.

What is refused, and why: a query or fragment (redis-py reads options from
the query; we have flags for those, and an ignored ``?timeout=`` would
mislead), a user without a password (``AUTH`` needs one, and sending none
would hide the mistake until the first ``NOAUTH``), and a path that is not
one database number.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

import attrs

from .errors import ConfigError

__all__ = [
    "MEMORY",
    "RedisAddress",
    "StateSettings",
    "masked_url",
    "parse_redis_url",
    "parse_state",
]

MEMORY = "memory"

DEFAULT_PORT = 6379
# Redis' own limit: `databases` is 16 by default; a server may be set
# higher, so only the form is checked here and SELECT tells the rest.
_EXPECTED = "redis://[USER:PASS@]HOST[:PORT][/DB] or rediss://... for TLS"


@attrs.frozen(kw_only=True)
class RedisAddress:
    """Where the shared state lives and how to log in.

    The password is kept out of ``repr`` (and so out of logs and tracebacks);
    ``display()`` is the form to show.
    """

    host: str
    port: int = DEFAULT_PORT
    tls: bool = False
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    db: int = 0

    def display(self) -> str:
        """The URL with the password masked, for logs and ``/status``."""
        scheme = "rediss" if self.tls else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host
        login = ""
        if self.password is not None:
            login = f"{self.username or ''}:***@"
        db = f"/{self.db}" if self.db else ""
        return f"{scheme}://{login}{host}:{self.port}{db}"


def parse_redis_url(text: str) -> RedisAddress:
    """Parse a ``redis://`` or ``rediss://`` URL.

    Args:
        text: ``redis://10.0.0.5:6379/2``, ``rediss://app:s3cret@redis:6380``,
            ``redis://:s3cret@[::1]``... User and password may be
            percent-encoded (``%40`` for ``@``).

    Returns:
        The address; the port defaults to 6379 and the database to 0.

    Raises:
        ValueError: the text is not such a URL; the message says why.
    """
    parts = urlsplit(text.strip())
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"expected {_EXPECTED}")
    if parts.query or parts.fragment or text.rstrip().endswith(("?", "#")):
        raise ValueError(f"a query or fragment is not accepted; expected {_EXPECTED}")
    try:
        port = parts.port  # raises on a non-number or out of range
        host = parts.hostname
    except ValueError as exc:
        raise ValueError(f"bad port ({exc}); expected {_EXPECTED}") from exc
    if not host:
        raise ValueError(f"no host; expected {_EXPECTED}")
    if port == 0:
        raise ValueError(f"port 0; expected {_EXPECTED}")
    username, password = _login(parts.username, parts.password)
    return RedisAddress(
        host=host,
        port=DEFAULT_PORT if port is None else port,
        tls=parts.scheme == "rediss",
        username=username,
        password=password,
        db=_db(parts.path),
    )


def _login(user: str | None, password: str | None) -> tuple[str | None, str | None]:
    """The decoded user and password; an empty user is none (``:PASS@`` = default user)."""
    if user is None and password is None:
        return None, None
    if password is None:
        raise ValueError(f"a user needs a password (USER:PASS@); expected {_EXPECTED}")
    if password == "":
        raise ValueError(f"an empty password; expected {_EXPECTED}")
    return (unquote(user) or None) if user else None, unquote(password)


def _db(path: str) -> int:
    """The database number of the URL's path (``""`` and ``/`` are 0)."""
    number = path.removeprefix("/")
    if not number:
        return 0
    if not (number.isascii() and number.isdigit()):
        raise ValueError(f"the path must be a database number, not {path!r}; expected {_EXPECTED}")
    return int(number)


def parse_state(text: str) -> RedisAddress | None:
    """``--state``'s value: None for ``memory`` (this process alone), else the Redis address.

    Raises:
        ValueError: neither ``memory`` nor a ``redis://``/``rediss://`` URL.
    """
    value = text.strip()
    if value == MEMORY:
        return None
    if "://" not in value:
        raise ValueError(f"expected memory or {_EXPECTED}")
    return parse_redis_url(value)  # its errors say what is wrong with the URL


def masked_url(text: str) -> str:
    """``text`` with the password of a ``USER:PASS@`` part shown as ``***``."""
    scheme, sep, rest = text.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        login, _, host = authority.rpartition("@")
        authority = f"{login.partition(':')[0]}:***@{host}"
    return scheme + sep + authority + slash + path


# -- the settings ------------------------------------------------------------------

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
