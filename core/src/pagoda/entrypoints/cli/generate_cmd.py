"""`pagoda generate "prompt"`: one completion, printed."""

from __future__ import annotations

import typer

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli.engine_options import with_engine_options


@with_engine_options()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    *,
    engine_args: EngineArgs,
) -> None:
    """Generate a completion for PROMPT (default model: SmolLM2-135M-Instruct)."""
    from pagoda.entrypoints.llm import LLM
    from pagoda.model_loader import ModelLoadError
    from pagoda.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        llm = LLM(**engine_args.model_dump())
    except ModelLoadError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    typer.echo(out.outputs[0].text)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
