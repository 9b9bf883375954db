"""The command line: options, the typer app and the re-exec into a lean process."""
