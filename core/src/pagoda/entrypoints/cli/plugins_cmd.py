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


@app.command("list")
def list_plugins() -> None:
    """Each plugin: name, kind, distribution, version, what it provides, loaded or the error."""
    from pagoda.platforms import probe_platforms

    pm = _manager()
    if not pm.infos:
        typer.echo("no plugins installed")
    pm.platforms()  # runs registration hooks so `provides` and hook errors are filled in
    for info in sorted(pm.infos, key=lambda i: (i.kind, i.name)):
        dist = f"{info.distribution or 'in-process'} {info.version or ''}".strip()
        typer.echo(f"{info.name:<16} {info.kind:<18} {dist:<34} {info.status}")
        if info.provides:
            typer.echo(f"    provides: {', '.join(info.provides)}")
        if info.error:
            typer.echo(f"    error: {info.error}")
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
