"""``${VAR}`` in node headers and client keys: replaced by the environment's values."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ...core.errors import ConfigError

__all__ = ["expand", "expand_env"]

_VAR_RE = re.compile(r"\$\{([^}]*)\}")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_env(template: str, environ: Mapping[str, str]) -> str:
    """Replace every ``${VAR}`` in ``template`` with the variable's value.

    A ``$`` not followed by ``{`` stays as it is. A variable that is set but
    empty is refused like an unset one: both usually mean a secret that did
    not reach the proxy, and an empty credential only turns into a stream of
    ``401`` answers.

    Raises:
        ValueError: ``VAR`` is not set, is empty, is not a variable name, or
            a ``${`` is not closed. The message names the reference, never a value.
    """

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if not _VAR_NAME.fullmatch(name):
            raise ValueError(f"${{{name}}} is not a valid variable reference")
        if name not in environ:
            raise ValueError(f"environment variable {name} is not set")
        if not environ[name]:
            raise ValueError(f"environment variable {name} is empty")
        return environ[name]

    if "${" in _VAR_RE.sub("", template):
        raise ValueError("a ${ is not closed by }")
    return _VAR_RE.sub(substitute, template)


def expand(template: str, environ: Mapping[str, str], whose: str) -> str:
    """``expand_env``, with errors that quote the references and say who needs them.

    Raises:
        ConfigError: with ``option`` and ``source`` for the caller to fill in.
    """
    try:
        return expand_env(template, environ)
    except ValueError as exc:
        refs = " ".join(f"${{{ref}}}" for ref in _VAR_RE.findall(template)) or "${"
        raise ConfigError("", refs, f"{exc}; {whose}") from None
