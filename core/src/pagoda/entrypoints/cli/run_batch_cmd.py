"""`pagoda run-batch -i IN.jsonl -o OUT.jsonl`: OpenAI batch files offline (vLLM's `vllm run-batch`)."""

from __future__ import annotations

import logging

import typer

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli.engine_options import with_engine_options


@with_engine_options()
def run_batch(
    input_file: str = typer.Option(..., "-i", "--input-file",
                                   help="Local JSONL file of OpenAI batch requests (one per line)."),
    output_file: str = typer.Option(..., "-o", "--output-file",
                                    help="Local JSONL file to write, one result per input line, in input order."),
    chat_template: str | None = typer.Option(None, "--chat-template", help="Chat template file or inline Jinja."),
    trust_request_chat_template: bool = typer.Option(
        False, "--trust-request-chat-template", help="Accept a request line's own chat_template (arbitrary Jinja)."),
    enable_auto_tool_choice: bool = typer.Option(
        False, "--enable-auto-tool-choice", help='Answer tool_choice "auto" by parsing tool calls; needs --tool-call-parser.'),
    tool_call_parser: str | None = typer.Option(
        None, "--tool-call-parser", help="Tool-call parser: hermes, llama3_json, mistral, pythonic, or a plugin's."),
    tool_parser_plugin: str | None = typer.Option(
        None, "--tool-parser-plugin", help="Python file registering tool parsers (ToolParserManager.register_module)."),
    *,
    engine_args: EngineArgs,
) -> None:
    """Run a batch of /v1/chat/completions and /v1/completions requests through the server's handlers, no HTTP."""
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import default_sampling, served_names, supported_tasks
    from pagoda.entrypoints.openai.chat_template import load_chat_template
    from pagoda.entrypoints.openai.run_batch import check_files, run_batch_file
    from pagoda.entrypoints.openai.server_args import ServerArgs
    from pagoda.entrypoints.openai.serving_common import ServingContext
    from pagoda.entrypoints.openai.tool_calls import resolve_tool_parser
    from pagoda.model_loader import ModelLoadError
    from pagoda.plugins import PluginError
    from pagoda.plugins.io_processors import get_io_processor

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        check_files(input_file, output_file)
        template = load_chat_template(chat_template)
        tool_parser = resolve_tool_parser(enable_auto_tool_choice, tool_call_parser, tool_parser_plugin)
    except (ValueError, OSError, ImportError) as exc:  # BatchFileError is a ValueError
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    server_args = ServerArgs.model_validate({"chat_template": chat_template})
    try:
        engine = AsyncLLM.from_engine_args(engine_args)
    except ModelLoadError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        io_processor = get_io_processor(engine.config, engine.model_config.io_processor_plugin)
    except PluginError as exc:
        engine.shutdown()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        ctx = ServingContext(
            engine=engine,
            served_model_names=served_names(engine_args, server_args),
            max_model_len=engine.max_model_len,
            max_logprobs=engine.model_config.max_logprobs,
            max_n=server_args.max_n,
            chat_template=template,
            trust_request_chat_template=trust_request_chat_template,
            default_sampling=default_sampling(engine),
            supported_tasks=supported_tasks(engine),
            io_processor=io_processor,
            enable_auto_tool_choice=enable_auto_tool_choice,
            tool_parser=tool_parser,
        )
        # twice the scheduler's batch keeps it full without holding the whole file in flight
        summary = run_batch_file(ctx, input_file, output_file, max_in_flight=2 * engine_args.max_num_seqs)
    finally:
        engine.shutdown()
    failed = f" (input lines {', '.join(map(str, summary.failed_lines[:20]))}{', ...' if summary.failed > 20 else ''})"
    typer.echo(f"{summary.total} request(s): {summary.succeeded} succeeded, {summary.failed} failed"
               f"{failed if summary.failed else ''}; results in {output_file}", err=True)


def register(app: typer.Typer) -> None:
    app.command("run-batch")(run_batch)
