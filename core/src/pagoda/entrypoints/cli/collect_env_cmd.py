"""`pagoda collect-env`: the environment, for bug reports (vLLM's `vllm collect-env`)."""

from __future__ import annotations

import typer


def collect_env() -> None:
    """Print OS, Python, torch, CPU features, GPUs, pagoda's distributions and plugins, and PAGODA_* variables."""
    from pagoda.entrypoints.cli.env_info import collect, render

    typer.echo(render(collect()))


def register(app: typer.Typer) -> None:
    app.command("collect-env")(collect_env)
