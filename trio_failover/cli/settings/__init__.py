"""Settings: the table of options and their resolution from four sources.

Every option is one row of ``OPTIONS``: its flag, its environment variable,
its key in the TOML file, how text and TOML values are parsed and how the
value is shown. ``resolve`` reads the flags, the environment and the config
file, applies the precedence flag > environment > file > default, builds the
``Config`` and returns, next to it, the ``Source`` of every value.

The precedence, its two exceptions (``--capacity``: ``capacity.py``; the
lists, taken whole from one source) and the errors (every value given is
checked, every mistake reported, each naming the option, its source and
the value, never a secret) are told in docs/configuration.md (its opening
and "Errors"). ``Config``'s own validators only know attribute names; their
errors are relabelled here.

The package reads the config file but imports neither trio nor time; of
the package's folders it imports ``core/`` only. Its modules, in the order
a value passes through them:

- ``options.py``: the option table, ``OPTIONS``; ``kinds.py``: how each
  type of value is parsed and shown;
- ``given.py``: the flags, environment and file as raw values with their
  ``Source`` (``sources.py``, with ``Mistakes``, the errors collected);
  ``toml_file.py``: the config file and the line of each key;
  ``expand.py``: ``${VAR}`` in node headers and client keys;
- ``nodes.py``, ``capacity.py``, ``clients.py``: the lists and their
  precedence rules;
- ``resolution.py``: ``resolve``, everything into one ``Config``;
- ``listing.py``: ``describe``, the rows ``check`` prints.
"""

from .expand import expand_env
from .kinds import Kind
from .listing import describe
from .options import ENV_PREFIX, OPTIONS, Option, option
from .resolution import place, resolve
from .sources import Source
from .toml_file import ConfigFile

__all__ = [
    "ENV_PREFIX",
    "OPTIONS",
    "ConfigFile",
    "Kind",
    "Option",
    "Source",
    "describe",
    "expand_env",
    "option",
    "place",
    "resolve",
]
