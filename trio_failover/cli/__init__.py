"""The command line: the typer app, its commands, the settings and the re-exec.

``cli.py`` holds the commands (``serve``, ``check``, ``demo``); ``settings/``
resolves every option from flags, environment and file. It may import every
folder below it; it imports ``service/`` inside ``serve`` and ``demo/``
inside ``demo`` only, so ``check`` stays fast and ``serve`` never loads the
fakes.
"""
