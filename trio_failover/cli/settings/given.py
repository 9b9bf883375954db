"""What the user gave: flags, environment and config file, read as raw values with sources.

Nothing here parses a value; the kinds (``kinds.py``) and the resolvers of
nodes, capacity and client keys do. This only knows where each option can
be given and in which order the sources are asked: flag, environment, file
(then, for ``--otel-endpoint``, OpenTelemetry's own variable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from .options import BY_NAME, Option
from .sources import DEFAULT, Source
from .toml_file import MISSING, ConfigFile

__all__ = ["Given"]


@attrs.frozen
class Given:
    """The three sources as ``resolve`` received them.

    ``flags`` maps an option's name to its text (a list for a ``repeat``
    option; ``None`` or no key: not given); ``environ`` is the environment;
    ``file`` the config file, if there is one.
    """

    flags: Mapping[str, object]
    environ: Mapping[str, str]
    file: ConfigFile | None

    def flag_list(self, opt: Option) -> list[str]:
        """The values of a ``repeat`` flag, in the order given ([] if none)."""
        values = self.flags.get(opt.name)
        if not values:
            return []
        if isinstance(values, str) or not isinstance(values, Sequence):
            raise TypeError(f"{opt.name}: expected a list of strings, got {values!r}")
        return [str(value) for value in values]

    def values(self, opt: Option) -> list[tuple[object, Source]]:
        """Every value a one-value option is given, highest precedence first."""
        raws: list[tuple[object, Source]] = []
        if self.flags.get(opt.name) is not None:
            raws.append((self.flags[opt.name], Source("flag", opt.flag, self.flags[opt.name])))
        if opt.env in self.environ:
            raws.append((self.environ[opt.env], Source("env", opt.env, self.environ[opt.env])))
        if self.file is not None and opt.toml is not None:
            raw = self.file.lookup(opt.toml)
            if raw is not MISSING:
                raws.append((raw, Source("file", self.file.where(*opt.toml), raw)))
        # Empty means unset, as OpenTelemetry's own variables are read.
        if opt.fallback_env and self.environ.get(opt.fallback_env):
            raw = self.environ[opt.fallback_env]
            raws.append((raw, Source("env", opt.fallback_env, raw)))
        return raws

    def config_source(self) -> Source:
        """Who named the config file: ``--config``, its variable, the caller, or nobody."""
        opt = BY_NAME["config"]
        path = self.flags.get("config")
        if path is not None:
            return Source("flag", opt.flag, path)
        if opt.env in self.environ:
            return Source("env", opt.env, self.environ[opt.env])
        if self.file is not None:
            return Source("file", self.file.name, self.file.name)
        return DEFAULT
