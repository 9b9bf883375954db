"""Resolution: the given values parsed, checked and combined into one ``Config``.

Every value that is given is checked, even one that a higher-precedence
source overrides, and every mistake is collected before one error is raised.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

import attrs

from ...core.config import Config
from ...core.errors import ConfigError
from ...core.redis_url import masked_url
from .capacity import resolve_capacity, resolve_engines
from .clients import resolve_clients
from .given import Given
from .kinds import SECRET, STATE, expected_of
from .nodes import resolve_nodes
from .options import BY_FIELD, BY_NAME, OPTIONS, Option
from .sources import DEFAULT, Mistakes, Source
from .toml_file import ConfigFile

__all__ = ["place", "resolve"]

_FIELDS = attrs.fields_dict(Config)


def _label(opt: Option, source: Source) -> str:
    return opt.toml_key if source.kind == "file" and opt.toml else opt.label


def _parse(opt: Option, raw: object, source: Source) -> Any:
    """One given value, parsed and checked by ``Config``'s own validator of its field.

    ``source.raw`` is what an error quotes (``***`` for a secret).
    """
    try:
        if source.kind == "file":
            value = opt.kind.from_toml(raw)
        elif not isinstance(raw, str):
            raise TypeError(f"{opt.name}: expected a string from {source.kind}, got {raw!r}")
        else:
            value = opt.kind.from_text(raw)
        attribute = _FIELDS[opt.field] if opt.field else None
        if attribute is not None and attribute.validator is not None:
            attribute.validator(None, attribute, value)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            expected = exc.expected
        elif source.kind == "file" and opt.toml:
            expected = expected_of(exc, opt.toml[-1])
        else:
            expected = str(exc)
        raise ConfigError(_label(opt, source), source.raw, expected, source.where) from None
    return value


def _relabel(exc: ConfigError, sources: Mapping[str, Source]) -> ConfigError:
    """Give an error from ``Config``'s validators the user's option name and source."""
    opt = BY_FIELD.get(exc.option)
    if opt is None or opt.field is None:
        return exc
    source = sources.get(opt.field, DEFAULT)
    value = exc.value if source.raw is None else source.raw
    return ConfigError(_label(opt, source), value, exc.expected, source.where or opt.flag)


def place(exc: ConfigError, sources: Mapping[str, Source]) -> ConfigError:
    """An error raised while serving, which knows only its option, naming the value's source.

    Serving refuses some values only when it uses them (an address already
    taken); its error names the flag (``--listen``). With the ``sources`` of
    ``resolve`` it names where the value came from, as every other error does.
    """
    if exc.source not in (exc.option, "--" + exc.option):
        return exc
    return _relabel(
        ConfigError(exc.option.replace("-", "_"), exc.value, exc.expected, exc.source), sources
    )


def _resolve_options(
    given: Given, sources: dict[str, Source], mistakes: Mistakes
) -> tuple[dict[str, Any], set[str]]:
    """The options of one value each (flag > env > file): the values, and the fields in error."""
    kwargs: dict[str, Any] = {}
    failed: set[str] = set()
    for opt in OPTIONS:
        if opt.field is None:
            continue
        parsed: list[tuple[Any, Source]] = []
        for raw, source in given.values(opt):
            if opt.secret:
                source = attrs.evolve(source, raw=SECRET)
            elif opt.kind is STATE and isinstance(raw, str):
                source = attrs.evolve(source, raw=masked_url(raw))  # a password in the URL
            try:
                parsed.append((_parse(opt, raw, source), source))
            except ConfigError as exc:
                mistakes.add(exc)
                failed.add(opt.field)
        if parsed:
            kwargs[opt.field], sources[opt.field] = parsed[0]
        else:
            sources[opt.field] = DEFAULT
    return kwargs, failed


def resolve(
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    file: ConfigFile | None = None,
) -> tuple[Config, dict[str, Source]]:
    """Build the ``Config`` from flags, environment and config file.

    Args:
        flags: option name (``OPTIONS[i].name``) to the text given on the
            command line; the ``repeat`` options (``upstream``, ``capacity``,
            ``engine``, ``api_key``) map to a list of strings. ``None`` or a missing key
            means "not given".
        environ: the environment (``os.environ``); read for the
            ``TRIO_FAILOVER_*`` variables and for ``${VAR}`` in node headers
            and client keys.
        file: an already parsed config file; by default the file named by
            ``--config`` or ``TRIO_FAILOVER_CONFIG`` is read, if any.

    Returns:
        The config and the source of every value: keyed by ``Config`` field
        name, plus ``"config"`` (the file), ``"upstreams"`` (the node list),
        ``"upstream:NAME"``, ``"capacity:NAME"`` and ``"engine:NAME"`` for
        each node,
        ``"clients"`` (the key list) and ``"client:NAME"`` for each client.

    Raises:
        ConfigError: a bad value, with ``source`` set to the flag, the
            environment variable or ``file:line``; ``ConfigErrors`` (a
            ``ConfigError`` too) when there are several, with every one of
            them. A config file that cannot be read or is not TOML stops
            the checks at once.
        TypeError: ``flags`` names an option that does not exist (a bug in
            the caller, not a user error).
    """
    unknown = sorted(set(flags) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unknown option names in flags: {', '.join(unknown)}")
    given = Given(flags, environ, file)
    sources: dict[str, Source] = {"config": given.config_source()}
    if file is None and sources["config"].raw is not None:
        file = ConfigFile.read(str(sources["config"].raw), sources["config"])
        given = attrs.evolve(given, file=file)

    mistakes = Mistakes()
    for mistake in file.mistakes if file is not None else ():
        mistakes.add(mistake)
    kwargs, failed = _resolve_options(given, sources, mistakes)
    nodes = resolve_nodes(given, sources, mistakes)
    capacities = resolve_capacity(given, nodes, sources, mistakes)
    engines = resolve_engines(given, nodes, sources, mistakes)
    kwargs["clients"] = resolve_clients(given, sources, mistakes)
    if not failed & {"tls_cert", "tls_key"}:
        with mistakes.catch():
            _check_tls_pair(kwargs, sources)
    mistakes.raise_if_any(None if file is None else file.name)
    assert nodes is not None  # else a mistake was recorded
    kwargs["upstreams"] = tuple(
        attrs.evolve(
            entry.node, capacity=capacities[entry.node.name], engine=engines[entry.node.name]
        )
        for entry in nodes
    )
    try:
        config = Config(**kwargs)
    except ConfigError as exc:
        raise _relabel(exc, sources) from None
    return config, sources


def _check_tls_pair(kwargs: Mapping[str, Any], sources: Mapping[str, Source]) -> None:
    cert, key = kwargs.get("tls_cert"), kwargs.get("tls_key")
    if cert is not None and key is not None:
        _load_tls_pair(cert, key, sources)
    if (cert is None) == (key is None):
        return
    given_opt, missing = (
        ("tls_cert", "--tls-key") if "tls_cert" in kwargs else ("tls_key", "--tls-cert")
    )
    source = sources[given_opt]
    raise ConfigError(
        _label(BY_NAME[given_opt], source),
        source.raw,
        f"TLS needs both a certificate and a key; give {missing} as well",
        source.where,
    )


def _load_tls_pair(cert: str, key: str, sources: Mapping[str, Source]) -> None:
    """Load the listener's certificate and key as serving does: ``check`` refuses what it would."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        # An empty passphrase: an encrypted key fails here instead of prompting.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        source = sources["tls_cert"]
        raise ConfigError(
            _label(BY_NAME["tls_cert"], source),
            source.raw,
            f"cannot load the certificate and key ({exc})",
            source.where,
        ) from None
