"""The command line: ``trio-failover serve | check | demo | --version``.

Thin on purpose: the options are generated from ``settings.OPTIONS``, every
value reaches ``settings.resolve`` as the text the user typed (typer does no
conversion, so that errors name the source the same way for flags,
environment and file), and the commands only hand the resulting ``Config``
to the server or print it. Modules that import trio are imported inside the
commands, so ``check`` and bad-value errors stay fast.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import typer

from ..core.config import Config
from ..core.errors import ConfigError, ConfigErrors
from ..core.redis_url import MEMORY
from ..core.version import __version__
from .loader import SettingsLoader
from .settings import OPTIONS, Source, describe, resolve
from .settings.kinds import BOOL

__all__ = ["app", "main"]

EXIT_CONFIG_ERROR = 2

app = typer.Typer(
    name="trio-failover",
    help="HTTP/1.1 failover reverse proxy for self-hosted LLM inference fleets.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _setting_options(
    func: Callable[..., None], extra: tuple[inspect.Parameter, ...] = ()
) -> Callable[..., None]:
    """Give ``func`` one keyword parameter per row of ``OPTIONS``, for typer to turn into flags.

    Every flag is a plain string (a list for the repeatable ones) defaulting
    to None, meaning "not given": the default belongs to lower-precedence sources.
    """
    params = []
    for opt in OPTIONS:
        annotation: Any = list[str] | None if opt.repeat else str | None
        if opt.kind is BOOL:  # a switch: given means true
            annotation = bool | None
        default = typer.Option(
            None,
            opt.flag,
            metavar=opt.metavar,
            help=f"{opt.help} [env: {opt.env}; default: {opt.default_text}]",
            show_default=False,
        )
        params.append(
            inspect.Parameter(
                opt.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
    params += extra
    func.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    return func


def _given(flags: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: _text(value) for name, value in flags.items() if value is not None and value != []
    }


def _settings(flags: Mapping[str, Any]) -> tuple[Config, dict[str, Source]]:
    """Resolve the settings, or print one line per mistake and exit with status 2."""
    given = _given(flags)
    try:
        config, sources = resolve(given, os.environ)
        _check_extras(config, sources)
        return config, sources
    except ConfigError as exc:
        for error in exc.errors if isinstance(exc, ConfigErrors) else (exc,):
            # One line each, whatever the value held: scripts grep it, humans read it.
            message = " ".join(str(error).splitlines())
            typer.echo(f"trio-failover: error: {message}", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None


def _text(value: Any) -> Any:
    # A switch's flag reaches resolve as text, like every other flag.
    return ("true" if value else "false") if isinstance(value, bool) else value


# The modules --otel-endpoint needs, from the ``otel`` extra.
OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def _check_extras(config: Config, sources: Mapping[str, Source]) -> None:
    """A setting whose optional packages are missing is a bad setting (exit 2), found now.

    Found, not imported: ``serve`` execs a fresh image, which imports them.
    """
    if config.otel_endpoint is not None and not all(map(_installed, OTEL_MODULES)):
        _missing_extra(sources, "otel_endpoint", "traces need the OpenTelemetry SDK", "otel")
    if config.state != MEMORY and not _installed("hiredis"):
        _missing_extra(sources, "state", "a Redis state needs hiredis", "redis")


# What each extra of the project installs, by the names a package index has
# (the project itself is installed from its own wheel, docs/deploying.md).
_EXTRAS = {
    "otel": "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http",
    "redis": "hiredis",
}


def _missing_extra(sources: Mapping[str, Source], field: str, what: str, extra: str) -> None:
    source = sources[field]
    label = field if source.kind == "file" else field.replace("_", "-")
    hint = f"{what}: the {extra} extra: pip install {_EXTRAS[extra]}"
    raise ConfigError(label, source.raw, hint, source.where)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing (or blocked)
        return False


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """Align ``(option, value, source)`` rows under a header, two spaces apart."""
    table = [("option", "value", "source"), *rows]
    widths = [max(len(row[column]) for row in table) for column in range(2)]
    return "\n".join(
        f"{option:<{widths[0]}}  {value:<{widths[1]}}  {source}".rstrip()
        for option, value, source in table
    )


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"trio-failover {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """HTTP/1.1 failover reverse proxy for self-hosted LLM inference fleets."""


@app.command()
@_setting_options
def serve(**flags: Any) -> None:
    """Run the proxy in the foreground; Ctrl-C or SIGTERM drains it."""
    config, sources = _settings(flags)
    # SIGHUP and --watch-config read the same sources again.
    path = sources["config"].raw
    loader = SettingsLoader(_given(flags), str(path) if path is not None else None, sources)
    if _as_program:
        from .reexec import exec_serve

        exec_serve(config, sys.argv, loader)  # returns only where it cannot (see reexec)
    if config.workers > 1:
        from ..service.workers import run_workers

        raise typer.Exit(run_workers(config, loader))
    from ..service.server import run_server

    raise typer.Exit(run_server(config, loader=loader))


# check's own option: not a setting, so not in OPTIONS.
_ADMIN_URL = inspect.Parameter(
    "admin_url",
    inspect.Parameter.KEYWORD_ONLY,
    default=typer.Option(
        None,
        "--admin",
        metavar="URL",
        help="A running proxy's admin listener: also print what a reload of it "
        "to these settings would change (asks GET /config, with --admin-token).",
    ),
    annotation=str | None,
)


def check(admin_url: str | None = None, **flags: Any) -> None:
    """Validate the settings and print each with its source."""
    config, sources = _settings(flags)
    typer.echo(format_table(describe(config, sources)))
    if admin_url is not None:
        from .compare import compare_with_running

        raise typer.Exit(compare_with_running(config, admin_url, typer.echo))


app.command(name="check")(_setting_options(check, (_ADMIN_URL,)))


@app.command()
def demo(
    once: bool = typer.Option(False, "--once", help="Run the scripted traffic once, then exit."),
) -> None:
    """Run a self-contained fleet, the proxy and scripted traffic."""
    from ..demo import run_demo

    raise typer.Exit(run_demo(once=once))


# Whether this process is the trio-failover program (set by ``main``), which
# ``serve`` may then replace with a fresh image of itself. An in-process call
# of ``app`` (a test's CliRunner, an embedder) never execs.
_as_program = False


def main() -> None:
    """Entry point of the ``trio-failover`` console script and ``python -m trio_failover``."""
    global _as_program
    _as_program = True
    app(prog_name="trio-failover")
