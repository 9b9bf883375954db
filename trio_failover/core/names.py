"""Pure: model names compared as the engines resolve them (docs/discovery.md).

One rule, Ollama's: a name without a ``:tag`` is the same model as
``NAME:latest``, so ``llama3.2`` and ``llama3.2:latest`` are one model. The
tag is what follows the last ``:`` after the last ``/`` (a registry's port,
``host:5000/llama3``, is no tag). Nothing else is folded: no case, no
blanks, no other tag, and never a node's own name for a client's one.

Every comparison of model names in the package goes through
``find_name``: the model filter of the candidates (``ranking.py``), the
configured ``models`` (``config.Upstream``), the name a node is sent
(``requests.py``) and the fleet's ``/v1/models`` (``inventory.py``). The
functions take the names as plain strings and collections; nothing here
knows a node.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

LATEST = ":latest"
WILDCARD = "*"  # a ``models`` mapping's key for every other name

# A node's configured ``models``: a mapping of the client's name to the
# node's name (what ``config.Upstream`` keeps; a list becomes an identity
# mapping), a list of names, a lone name, or None (not configured).
Configured = Mapping[str, str] | Sequence[str] | None


def spellings(name: str) -> tuple[str, str] | tuple[str]:
    """The names that mean the same model as ``name``, ``name`` itself first.

    ``llama3.2`` -> (``llama3.2``, ``llama3.2:latest``); ``llama3.2:latest``
    -> (``llama3.2:latest``, ``llama3.2``); a name with any other tag, or
    ``*``, is only itself.
    """
    last = name.rpartition("/")[2]
    if ":" not in last:
        return (name,) if not last or name == WILDCARD else (name, name + LATEST)
    if name.endswith(LATEST):
        base = name[: -len(LATEST)]
        stem = base.rpartition("/")[2]
        if stem and ":" not in stem:
            return (name, base)
    return (name,)


# ``model_key``'s answers, kept for the names it was asked: a fleet serves
# a handful of models and every request asks twice (its prompt's chain, its
# usage). Bounded in entries and in the length of a name kept, since a
# client may send any "model": past either bound the key is computed, not kept.
_KEYS: dict[str, str] = {}
_KEYS_KEPT = 512
_KEY_LENGTH = 256


def model_key(name: str) -> str:
    """One spelling for every name of the same model (``NAME:latest`` for a bare name).

    For grouping: two names mean the same model exactly when their keys are
    equal.
    """
    key = _KEYS.get(name)
    if key is None:
        alternatives = spellings(name)
        key = name if len(alternatives) == 1 or name.endswith(LATEST) else alternatives[1]
        if len(name) <= _KEY_LENGTH and len(_KEYS) < _KEYS_KEPT:
            _KEYS[name] = key
    return key


def same_model(first: str, second: str) -> bool:
    """Whether two names mean the same model."""
    return second in spellings(first)


def find_name(name: str, names: Collection[str]) -> str | None:
    """The entry of ``names`` that means the same model as ``name``, else None.

    An exact entry wins over the other spelling (a mapping may have both).
    ``names`` may be a mapping (its keys are searched in O(1)), a set or a
    sequence.
    """
    for spelling in spellings(name):
        if spelling in names:
            return spelling
    return None


def configured_names(configured: Configured) -> Collection[str]:
    """The client names a node's configured ``models`` names, ``"*"`` included."""
    if configured is None:
        return ()
    if isinstance(configured, str):  # a lone name given where a list belongs
        return (configured,)
    return configured


def accepts(model: str, configured: Configured) -> bool:
    """Whether a node's configured ``models`` take a request for ``model``.

    True with no configured ``models`` (the configuration excludes
    nothing), for a name in them (either spelling), and with ``"*"``.
    """
    if configured is None:
        return True
    names = configured_names(configured)
    return WILDCARD in names or find_name(model, names) is not None


def node_model_name(model: str, configured: Configured) -> str:
    """The name a node is sent for the client's ``model``.

    The client's own name, unless the node's ``models`` mapping gives
    another: the value of the key that means the same model (an exact key
    first), else the value of ``"*"``. An entry that maps a name to itself
    (a list entry) sends the client's spelling: ``models = ["llama3.2"]``
    and a request for ``llama3.2:latest`` send ``llama3.2:latest``.
    """
    if not isinstance(configured, Mapping):
        return model
    key = find_name(model, configured)
    if key is not None:
        mapped = configured[key]
        return model if mapped == key else mapped
    return configured.get(WILDCARD, model)
