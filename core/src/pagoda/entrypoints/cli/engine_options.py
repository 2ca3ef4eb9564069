"""Turn ``EngineArgs`` fields into CLI options, so the CLI never re-declares them."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

import typer

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli.vllm_flags import parse_size

# fields whose flag takes vLLM's human-readable sizes ("2k" = 2000, "2K" = 2048)
HUMAN_READABLE = ("max_model_len", "kv_cache_memory_bytes")


def _option_for(name: str, info: Any) -> tuple[Any, Any]:
    flag = "--" + name.replace("_", "-")
    annotation = info.annotation
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    help_text = info.description or ""
    default = info.default
    if annotation is bool:
        return bool, typer.Option(default, f"{flag}/--no-{name.replace('_', '-')}", help=help_text)
    if origin is typing.Literal:
        return str, typer.Option(default, flag, help=f"{help_text} One of: {', '.join(map(str, args))}.")
    inner = [a for a in args if a is not type(None)] or [annotation]
    base = inner[0]
    if typing.get_origin(base) is typing.Literal:
        return str | None, typer.Option(default, flag, help=help_text)  # type: ignore[return-value]
    if base is int and name in HUMAN_READABLE:
        return (int | None) if type(None) in args else int, typer.Option(  # type: ignore[return-value]
            default, flag, help=f"{help_text} Takes 2k (2000) or 2K (2048).", parser=parse_size)
    if base in (int, float, str):
        return (base | None) if type(None) in args else base, typer.Option(default, flag, help=help_text)
    # dicts (hf_overrides) travel as JSON text
    return str | None, typer.Option(None, flag, help=f"{help_text} (JSON)")  # type: ignore[return-value]


def _cli_fields() -> dict[str, Any]:
    """EngineArgs' fields by their CLI name: vLLM's EngineArgs name where a section's differs (the alias)."""
    return {info.alias or name: info for name, info in EngineArgs.model_fields.items()}


def engine_args_from_cli(values: dict[str, Any]) -> EngineArgs:
    cleaned: dict[str, Any] = {}
    for name, info in _cli_fields().items():
        if name not in values:
            continue
        value = values[name]
        if isinstance(value, str) and info.annotation not in (str, str | None) and "dict" in str(info.annotation):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise typer.BadParameter(f"--{name.replace('_', '-')} must be JSON: {exc}") from exc
        elif isinstance(value, str) and "list[str]" in str(info.annotation):
            # a JSON list, or vLLM's space-separated values (given as one argument) / comma-separated ones
            value = json.loads(value) if value.lstrip().startswith("[") else value.replace(",", " ").split()
        cleaned[name] = value
    return EngineArgs(**cleaned)


def with_engine_options(exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: append every EngineArgs field as a keyword option of the command.

    The wrapped function receives them in ``engine_args: EngineArgs``.
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(func)
        # Commands written under `from __future__ import annotations` carry string
        # annotations; typer reads the signature we hand it as-is, so resolve them here.
        hints = typing.get_type_hints(func, include_extras=True)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in sig.parameters.values()
            if p.name != "engine_args"
        ]
        extra: list[inspect.Parameter] = []
        for name, info in _cli_fields().items():
            if name in exclude or name in sig.parameters:
                continue
            annotation, default = _option_for(name, info)
            extra.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))

        def wrapper(**kwargs: Any) -> Any:
            engine_kwargs = {p.name: kwargs.pop(p.name) for p in extra}
            if "model" in sig.parameters and "model" in kwargs:
                engine_kwargs["model"] = kwargs["model"]
            kwargs["engine_args"] = engine_args_from_cli(engine_kwargs)
            return func(**kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
        wrapper.__name__ = func.__name__
        wrapper.__doc__ = func.__doc__
        return wrapper

    return decorate


def with_model_flag(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: vLLM's ``--model M`` beside the positional ``MODEL`` (vLLM still takes both; its classic
    ``python -m vllm.entrypoints.openai.api_server`` only the flag). Giving both with different values is an error."""
    sig = inspect.signature(func)
    flag = inspect.Parameter(
        "model_flag", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
        default=typer.Option(None, "--model", help="The model, as the positional MODEL (vLLM's spelling)."))

    def wrapper(**kwargs: Any) -> Any:
        given = kwargs.pop("model_flag")
        ctx: typer.Context = kwargs.pop("_model_flag_ctx")
        if given is not None:
            # a MODEL from --config yields to the command line's --model
            source = ctx.get_parameter_source("model")
            from_file = source is not None and source.name == "DEFAULT_MAP"
            if kwargs.get("model") not in (None, given) and not from_file:
                raise typer.BadParameter(f"the model is given twice: {kwargs['model']!r} and --model {given!r}")
            kwargs["model"] = given
        return func(**kwargs)

    params = list(sig.parameters.values())
    keyword_at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(params))
    params.insert(keyword_at, flag.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD))
    # typer hands the click context to a parameter annotated typer.Context
    params.insert(0, inspect.Parameter("_model_flag_ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                       annotation=typer.Context))
    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper
