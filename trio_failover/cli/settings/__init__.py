"""Settings: the table of options and their resolution from four sources.

Every option is one row of ``OPTIONS``: its flag, its environment variable,
its key in the TOML file, how text and TOML values are parsed and how the
value is shown. ``resolve`` reads the flags, the environment and the config
file, applies the precedence flag > environment > file > default, builds the
``Config`` and returns, next to it, the ``Source`` of every value.

Three rules shape the errors:

- Every value that is given is checked, even one that a higher-precedence
  source overrides: a broken line in the config file should not wait for the
  day somebody drops the flag that hid it.
- Every mistake is reported, not only the first: ``resolve`` raises one
  ``ConfigError`` for a single mistake and a ``ConfigErrors`` holding each
  of them for several, so that a file with five typos takes one round, not
  five.
- A ``ConfigError`` always names the option as the user wrote it (``--flag``
  name, or TOML key), the source (``--first-body-timeout``,
  ``TRIO_FAILOVER_FIRST_BODY_TIMEOUT`` or ``config.toml:12``), the value as
  given (never a header value, a client key or the admin token: those are
  secrets, and an error about one names the client or node instead) and
  what was expected. ``Config``'s own validators only know attribute names;
  their errors are relabelled here.

Two options do not follow flag > environment > file: ``--capacity``, whose
per-node values beat the bare default of a higher-precedence source (see
``capacity.py``), and the lists (``--upstream``, ``--api-key``), which
are taken whole from the first source that has one.

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
from .resolution import resolve
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
    "resolve",
]
