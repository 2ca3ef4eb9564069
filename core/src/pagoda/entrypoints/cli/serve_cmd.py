"""`pagoda serve [MODEL]`: the OpenAI-compatible server."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import typer

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli.engine_options import with_engine_options, with_model_flag
from pagoda.entrypoints.cli.help_groups import GroupedHelpCommand
from pagoda.entrypoints.cli.vllm_flags import load_config_file, parse_size


def _json_list(value: str, flag: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]': {exc}") from exc
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise typer.BadParameter(f"{flag} must be a JSON list of strings, got {value!r}")
    return parsed


@with_model_flag
@with_engine_options(exclude=("served_model_name",))
def serve(
    model: str | None = typer.Argument(None, help="HF model directory, .gguf file or hub id (org/name); none = SmolLM2-135M-Instruct."),
    more_models: list[str] | None = typer.Argument(
        None, metavar="[MORE_MODELS]...",
        help="Further models to serve on the same port (many models: each loads on its first request)."),
    config: str | None = typer.Option(
        None, "--config", is_eager=True, callback=load_config_file,
        help="YAML file of options (vLLM's: 'max-model-len: 2048', 'model: org/name'); the command line wins."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes the server to the network."),
    port: int = typer.Option(8000, "--port", help="Port to bind."),
    uds: str | None = typer.Option(None, "--uds", help="Serve on this Unix domain socket path instead of --host/--port."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="PAGODA_API_KEY",
                                       help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every path but /health, /ping, /metrics, /version "
                                            "(or PAGODA_API_KEY)."),
    served_model_name: list[str] | None = typer.Option(None, "--served-model-name",
                                                       help="Model name(s) the API answers to; repeatable."),
    lora_modules: list[str] | None = typer.Option(
        None, "--lora-modules",
        help="LoRA adapter to serve (needs --enable-lora): name=path, or vLLM's JSON "
             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; repeat the flag for several."),
    chat_template: str | None = typer.Option(None, "--chat-template", help="Chat template file or inline Jinja."),
    trust_request_chat_template: bool = typer.Option(
        False, "--trust-request-chat-template",
        help="Accept chat_template in requests (arbitrary Jinja run on the server); refused with 400 otherwise."),
    chat_template_render_timeout: float = typer.Option(
        5.0, "--chat-template-render-timeout",
        help="Seconds a chat template may take to render before the request fails (0 = unbounded)."),
    enable_auto_tool_choice: bool = typer.Option(
        False, "--enable-auto-tool-choice",
        help='Answer tool_choice "auto" (the default with tools) by parsing tool calls; needs --tool-call-parser.'),
    tool_call_parser: str | None = typer.Option(
        None, "--tool-call-parser", help="Tool-call parser: hermes, llama3_json, mistral, pythonic, or a plugin's."),
    tool_parser_plugin: str | None = typer.Option(
        None, "--tool-parser-plugin", help="Python file registering tool parsers (ToolParserManager.register_module)."),
    allowed_origins: str = typer.Option('["*"]', "--allowed-origins", help="CORS allowed origins (JSON list)."),
    allow_credentials: bool = typer.Option(False, "--allow-credentials", help="CORS: allow credentials."),
    allowed_methods: str = typer.Option('["*"]', "--allowed-methods", help="CORS allowed methods (JSON list)."),
    allowed_headers: str = typer.Option('["*"]', "--allowed-headers", help="CORS allowed headers (JSON list)."),
    allowed_hosts: str = typer.Option(
        '["*"]', "--allowed-hosts",
        help='Host headers answered (JSON list: names, "*.domain"; "*" = any, the default); others get 400.'),
    max_request_body_bytes: int = typer.Option(16 * 1024 * 1024, "--max-request-body-bytes",
                                               help="Largest request body accepted (413 above)."),
    max_n: int = typer.Option(128, "--max-n", help="Largest n / best_of per request."),
    responses_store_max_entries: int = typer.Option(
        1000, "--responses-store-max-entries",
        help="Responses kept in memory for GET /v1/responses/{id} and previous_response_id (LRU; 0 = none)."),
    shutdown_timeout: float = typer.Option(10.0, "--shutdown-timeout",
                                           help="Seconds in-flight requests may take to finish on SIGINT/SIGTERM."),
    enable_tokenizer_info_endpoint: bool = typer.Option(
        False, "--enable-tokenizer-info-endpoint",
        help="Serve GET /tokenizer_info: the tokenizer's configuration and chat template (for remote tokenizers)."),
    uvicorn_log_level: str = typer.Option("info", "--uvicorn-log-level", help="uvicorn's log level."),
    enable_log_requests: bool = typer.Option(False, "--enable-log-requests/--disable-log-requests",
                                             help="Log every request (access log); off by default, as in vLLM."),
    vllm_metric_names: bool = typer.Option(
        False, "--vllm-metric-names",
        help="Export every /metrics metric as vLLM's vllm:* too, beside pagoda:* (for vLLM's dashboards)."),
    disable_log_stats: bool = typer.Option(
        False, "--disable-log-stats", help="Record no engine statistics (the /metrics counters stay at zero)."),
    models_config: str | None = typer.Option(
        None, "--models-config",
        help="YAML file of models to serve on one port ('models:' a list, each 'model:' plus its own engine "
             "options, served_model_name, lora_modules, keep_alive); pagoda's, beyond vLLM."),
    max_loaded_models: int | None = typer.Option(
        None, "--max-loaded-models", min=1,
        help="Many models: the most loaded at once; loading another evicts the least recently used idle one."),
    models_memory_budget: int | None = typer.Option(
        None, "--models-memory-budget", parser=parse_size,
        help="Many models: bytes of weights + KV cache the loaded models may hold together (e.g. 8G); "
             "the least recently used idle ones are evicted past it."),
    model_idle_timeout: float | None = typer.Option(
        None, "--model-idle-timeout", min=0,
        help="Many models: seconds a model may idle before it unloads (a request's keep_alive wins); none = never."),
    max_parked_models: int = typer.Option(
        2, "--max-parked-models", min=0,
        help="Many models: evicted or idle models kept asleep (process alive, woken by the next request); past "
             "this many the least recently used parked one shuts down; 0 = unload at once."),
    model_load_timeout: float = typer.Option(
        600.0, "--model-load-timeout", min=0.001,
        help="Many models: seconds a request waits for its model to load before a 503."),
    swap_space: float | None = typer.Option(
        None, "--swap-space", min=0,
        help="vLLM's CPU swap space (GiB); accepted and unused, as in vLLM's V1 engine: a preempted request "
             "is recomputed, never swapped."),
    *,
    engine_args: EngineArgs,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (default: SmolLM2-135M-Instruct on 127.0.0.1:8000)."""
    started = time.perf_counter()
    from pydantic import ValidationError

    from pagoda.entrypoints.openai.chat_template import load_chat_template
    from pagoda.entrypoints.openai.server_args import ServerArgs

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if swap_space is not None:
        logging.getLogger(__name__).warning(
            "--swap-space %g has no effect: pagoda preempts by recomputing the request, as vLLM's V1 engine "
            "(which ignores it too)", swap_space)
    try:
        from pagoda.entrypoints.openai.lora_modules import LoRAModulePath

        for module in lora_modules or []:
            LoRAModulePath.parse(module)  # a malformed entry fails before the model loads
        if lora_modules and not engine_args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        load_chat_template(chat_template)
        server_args = ServerArgs(
            host=host, port=port, api_key=api_key, served_model_name=served_model_name or None,
            lora_modules=lora_modules or None,
            chat_template=chat_template, trust_request_chat_template=trust_request_chat_template,
            chat_template_render_timeout=chat_template_render_timeout,
            enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
            tool_parser_plugin=tool_parser_plugin,
            allowed_origins=_json_list(allowed_origins, "--allowed-origins"), allow_credentials=allow_credentials,
            allowed_methods=_json_list(allowed_methods, "--allowed-methods"),
            allowed_headers=_json_list(allowed_headers, "--allowed-headers"),
            allowed_hosts=_json_list(allowed_hosts, "--allowed-hosts"),
            max_request_body_bytes=max_request_body_bytes, max_n=max_n, shutdown_timeout=shutdown_timeout,
            responses_store_max_entries=responses_store_max_entries,
            enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint, uds=uds,
            disable_log_stats=disable_log_stats, vllm_metric_names=vllm_metric_names,
            uvicorn_log_level=uvicorn_log_level, disable_log_requests=not enable_log_requests,
            max_loaded_models=max_loaded_models, models_memory_budget=models_memory_budget,
            model_idle_timeout=model_idle_timeout, model_load_timeout=model_load_timeout,
            max_parked_models=max_parked_models,
        )
        models = _model_specs(engine_args, more_models or [], models_config, served_model_name, lora_modules)
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if served_model_name:
        engine_args = engine_args.model_copy(update={"served_model_name": served_model_name[0]})
    from pagoda.entrypoints.openai.listen import bind_socket

    # Listening first: a second server on a busy address fails here, before anything heavy has started.
    try:
        sock = bind_socket(host, port, uds)
    except OSError as exc:
        typer.echo(f"error: cannot listen on {uds or f'{host}:{port}'}: {exc}", err=True)
        raise typer.Exit(1) from exc
    _start_standby_core(engine_args)
    # the heavy imports (fastapi, torch, the model stack) come after the standby core began its own
    from pagoda.entrypoints.openai.api_server import run_server
    from pagoda.model_loader import ModelLoadError
    from pagoda.plugins import PluginError

    from pagoda.engine.async_llm import EngineDeadError
    from pagoda.engine.mp_client import EngineCoreStartupError

    try:
        run_server(engine_args, server_args, sock=sock, started=started, models=models)
    except (ModelLoadError, PluginError, OSError) as exc:  # an OSError is the model's (not found): the socket is bound
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except EngineDeadError as exc:
        # the engine core died while serving: exit non-zero so a supervisor restarts the server (vLLM's way)
        typer.echo(f"error: {exc}; the server stopped", err=True)
        raise typer.Exit(1) from exc
    except (ValueError, EngineCoreStartupError) as exc:
        # a start-up option the model cannot take (max_model_len past its positions, a step budget below
        # it, ...): the message says which; the traceback is the engine's, not the user's (logged at debug)
        logging.getLogger(__name__).debug("start-up failed", exc_info=True)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


def _model_specs(engine_args: EngineArgs, more_models: list[str], models_config: str | None,
                 served_model_name: list[str] | None, lora_modules: list[str] | None) -> list[Any] | None:
    """The models of a many-model server (several MODELs or --models-config); None: the one-model server."""
    if not more_models and models_config is None:
        return None
    from pagoda.entrypoints.openai.model_pool import served_name_index, spec_for_model, specs_from_config

    if served_model_name or lora_modules:
        raise ValueError("--served-model-name and --lora-modules name one model's names and adapters: with several "
                         "models give them per model in --models-config")
    positional = ([engine_args.model] if engine_args.model else []) + more_models
    specs = [spec_for_model(m, engine_args) for m in positional]
    if models_config is not None:
        specs += specs_from_config(models_config, engine_args)
    served_name_index(specs)
    return specs


def _start_standby_core(engine_args: EngineArgs) -> None:
    """Spawn the engine-core process now when the engine will run its core in a process, so its imports
    (torch, the model stack: ~2 s) overlap this process's own imports and config resolution."""
    from pagoda.engine.core_process import standby_config_imports, start_standby_core
    from pagoda.engine.mp_client import engine_core_in_process

    try:
        in_process = engine_core_in_process(engine_args.world_size, engine_args.data_parallel_size, True)
    except ValueError:
        return  # a malformed PAGODA_ENABLE_V1_MULTIPROCESSING: the engine's own start reports it
    if in_process:
        start_standby_core(config_imports=standby_config_imports(engine_args.model, engine_args.model_impl))


def register(app: typer.Typer) -> None:
    app.command("serve", cls=GroupedHelpCommand)(serve)


def api_server_main(argv: list[str] | None = None) -> None:
    """``python -m pagoda.entrypoints.openai.api_server --model M ...``: vLLM's classic entrypoint (Docker
    images, Kubernetes manifests), the same command with every option of `pagoda serve`."""
    # plain help, as `pagoda`'s: rich's tables cut flag names at 80 columns
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command(cls=GroupedHelpCommand)(serve)
    app(args=argv, prog_name="python -m pagoda.entrypoints.openai.api_server")
