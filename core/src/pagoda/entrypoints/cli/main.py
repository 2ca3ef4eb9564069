"""The `pagoda` command line (typer)."""

from __future__ import annotations

import typer

from pagoda.entrypoints.cli import plugins_cmd
from pagoda.version import __version__

app = typer.Typer(
    name="pagoda",
    help="pagoda: a high-throughput LLM inference and serving engine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # click's plain help: rich's tables cut long flag names ("--enable-prefix-ca…") at 80 columns or when piped
    rich_markup_mode=None,
)
app.add_typer(plugins_cmd.app, name="plugins")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"pagoda {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Show the version and exit."),
) -> None:
    """pagoda: a high-throughput LLM inference and serving engine."""


def _register_optional_commands() -> None:
    # Commands added by later modules register themselves here; importing them is
    # cheap (no torch at import time).
    from importlib import import_module

    for module in ("generate_cmd", "serve_cmd", "chat_cmd", "run_batch_cmd", "collect_env_cmd", "bench_cmd"):
        try:
            mod = import_module(f"pagoda.entrypoints.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"pagoda.entrypoints.cli.{module}":
                raise
            continue
        mod.register(app)


_register_optional_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
