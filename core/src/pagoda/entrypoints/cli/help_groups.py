"""`pagoda serve --help` as vLLM's: options in groups (vLLM's config classes, ``Frontend`` for the server's own),
full flag names at any width, and ``--help=<group|flag keyword|listgroup|all>``."""

from __future__ import annotations

from typing import Any

import typer
from pydantic import BaseModel
from typer.core import TyperCommand

from pagoda.config import EngineArgs, EngineConfig

FRONTEND = "Frontend"  # vLLM's group of the API server's own options
_HINT = ("--help=<group> shows one group (--help=listgroup names them), --help=<keyword> the options whose "
         "flag holds it (--help=max), --help=all everything.")


def _engine_groups() -> dict[str, str]:
    """EngineArgs field -> the name of the EngineConfig part that holds it (ModelConfig, CacheConfig, ...)."""
    groups: dict[str, str] = {}
    for info in EngineConfig.model_fields.values():
        part = info.annotation
        if isinstance(part, type) and issubclass(part, BaseModel):
            for name in part.model_fields:
                groups.setdefault(name, part.__name__)
    return groups


class GroupedHelpCommand(TyperCommand):
    """A command whose help lists its options by group and answers vLLM's ``--help=QUERY``."""

    def _group_of(self, param: Any, groups: dict[str, str]) -> str:
        name = "model" if param.name == "model_flag" else (param.name or "")
        if name in EngineArgs.model_fields:
            return groups.get(name, "EngineArgs")
        return FRONTEND

    def _grouped(self, ctx: typer.Context) -> dict[str, list[tuple[Any, tuple[str, str]]]]:
        groups = _engine_groups()
        out: dict[str, list[tuple[Any, tuple[str, str]]]] = {}
        for param in self.get_params(ctx):
            if param.param_type_name != "option":
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                out.setdefault(self._group_of(param, groups), []).append((param, record))
        return out

    def format_options(self, ctx: typer.Context, formatter: Any) -> None:
        self._format_groups(formatter, self._grouped(ctx))

    @staticmethod
    def _format_groups(formatter: Any,
                       groups: dict[str, list[tuple[Any, tuple[str, str]]]]) -> None:
        for name, rows in groups.items():
            with formatter.section(name):
                formatter.write_dl([record for _, record in rows])

    def format_epilog(self, ctx: typer.Context, formatter: Any) -> None:
        super().format_epilog(ctx, formatter)
        formatter.write_paragraph()
        formatter.write_text(_HINT)

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        for arg in args:
            if arg.startswith("--help="):
                self._answer_help_query(ctx, arg.split("=", 1)[1])
        return super().parse_args(ctx, args)

    def _answer_help_query(self, ctx: typer.Context, query: str) -> Any:
        groups = self._grouped(ctx)
        if query == "all":
            typer.echo(self.get_help(ctx), color=ctx.color)
            ctx.exit(0)
        if query == "listgroup":
            typer.echo("\n".join(groups))
            ctx.exit(0)
        formatter = ctx.make_formatter()
        by_lower = {name.lower(): name for name in groups}
        if query.lower() in by_lower:
            name = by_lower[query.lower()]
            self._format_groups(formatter, {name: groups[name]})
        else:
            keyword = query.lstrip("-").replace("_", "-").lower()
            found = {name: [(p, r) for p, r in rows if keyword and any(keyword in o.lower() for o in
                                                                         [*p.opts, *p.secondary_opts])]
                     for name, rows in groups.items()}
            found = {name: rows for name, rows in found.items() if rows}
            if not found:
                ctx.fail(f"--help={query}: no group or option flag matches it; the groups are {', '.join(groups)}")
            self._format_groups(formatter, found)
        typer.echo(formatter.getvalue().rstrip("\n"))
        ctx.exit(0)
