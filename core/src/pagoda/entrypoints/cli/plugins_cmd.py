"""`pagoda plugins list|info`."""

from __future__ import annotations

import typer

app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)


def _manager():  # type: ignore[no-untyped-def]
    from pagoda.plugins import PluginSelectionError, get_plugin_manager

    try:
        return get_plugin_manager()
    except PluginSelectionError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _echo_architectures() -> None:
    """Every architecture a family implements, with its family and implementation, then the fallback's row."""
    from pagoda.models.registry import FALLBACK_DISTRIBUTION, ModelRegistry

    typer.echo("\narchitectures:")
    rows = ModelRegistry.architectures()
    width = max([len("(any other)"), *(len(arch) for arch, _, _ in rows)])
    for arch, family, implementation in rows:
        typer.echo(f"  {arch:<{width}} {family:<30} {implementation}")
    fallback = ModelRegistry.fallback()
    if fallback is None:
        typer.echo(
            f"  {'(any other)':<{width}} {'-':<30} refused: no transformers fallback installed "
            f"(pip install {FALLBACK_DISTRIBUTION})"
        )
        return
    info = _manager().provider_of("model_fallbacks", fallback.name)
    family = (info.distribution or info.name) if info is not None else "in-process plugin"
    what = f": {fallback.description}" if fallback.description else ""
    typer.echo(f"  {'(any other)':<{width}} {family:<30} transformers fallback{what}")
    typer.echo("  (ask about one architecture: pagoda plugins list --architecture NAME [--model-impl ...])")


def _echo_resolutions(architectures: list[str], model_impl: str, trust_remote_code: bool) -> bool:
    """How each named architecture would be served; False when one cannot be."""
    from pagoda.models.registry import ModelRegistry, UnsupportedArchitectureError

    ok = True
    for arch in architectures:
        try:
            typer.echo(ModelRegistry.resolve([arch], model_impl, trust_remote_code=trust_remote_code).describe())
        except (UnsupportedArchitectureError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            ok = False
    return ok


@app.command("list")
def list_plugins(
    architecture: list[str] = typer.Option(  # noqa: B008
        [], "--architecture", "-a",
        help="Say which implementation would serve this architecture (repeatable); exit 1 if none can.",
    ),
    model_impl: str = typer.Option("auto", "--model-impl", help="With --architecture: auto, pagoda or transformers."),
) -> None:
    """Each plugin: name, kind, distribution, version, what it provides, loaded or the error; every
    architecture with its family and implementation."""
    from pagoda.platforms import probe_platforms

    pm = _manager()
    if architecture:
        if not _echo_resolutions(architecture, model_impl, trust_remote_code=False):
            raise typer.Exit(1)
        return
    if not pm.infos:
        typer.echo("no plugins installed")
    pm.platforms()  # runs registration hooks so `provides` and hook errors are filled in
    kind_width = max([18, *(len(info.kind) for info in pm.infos)])
    for info in sorted(pm.infos, key=lambda i: (i.kind, i.name)):
        dist = f"{info.distribution or 'in-process'} {info.version or ''}".strip()
        typer.echo(f"{info.name:<16} {info.kind:<{kind_width}} {dist:<34} {info.status}")
        if info.provides:
            typer.echo(f"    provides: {', '.join(info.provides)}")
        if info.error:
            typer.echo(f"    error: {info.error}")
    _echo_architectures()
    rows = probe_platforms()
    if rows:
        typer.echo("\nplatforms:")
        specs = pm.platforms()
        for name, ok, reason in rows:
            verified = "" if specs[name].verified_on_hardware else " [not verified on hardware]"
            state = "available" if ok else f"unavailable: {reason}"
            typer.echo(f"  {name:<6} {state}{verified}")


@app.command("info")
def info(name: str) -> None:
    """Everything known about one plugin, with the traceback if it failed."""
    pm = _manager()
    pm.platforms()
    matches = [i for i in pm.infos if name in (i.name, i.distribution)]
    if not matches:
        known = ", ".join(sorted({i.name for i in pm.infos})) or "none"
        typer.echo(f"error: no plugin named {name!r}; installed: {known}", err=True)
        raise typer.Exit(1)
    for i in matches:
        typer.echo(f"name:         {i.name}")
        typer.echo(f"kind:         {i.kind}")
        typer.echo(f"distribution: {i.distribution} {i.version or ''}")
        typer.echo(f"entry point:  {i.entry_point}")
        typer.echo(f"api version:  {i.api_version}")
        typer.echo(f"status:       {i.status}")
        if i.provides:
            typer.echo(f"provides:     {', '.join(i.provides)}")
        if i.error:
            typer.echo(f"error:        {i.error}")
        if i.traceback:
            typer.echo(i.traceback)
