"""The OpenAI-compatible server: ``build_app(engine, args)`` and ``run_server(engine_args, server_args)``."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from pagoda import envs
from pagoda.config import EngineArgs
from pagoda.engine.async_llm import AsyncLLM, EngineDeadError
from pagoda.entrypoints.anthropic.routes import add_anthropic_routes
from pagoda.entrypoints.openai.chat_template import load_chat_template
from pagoda.entrypoints.openai.listen import bind_socket  # noqa: F401 - its old home
from pagoda.entrypoints.openai.errors import (
    APIError,
    error_body,
    install_error_handlers,
    parse_json_body,
    validation_error,
)
from pagoda.entrypoints.openai.middleware import AllowedHostsMiddleware, APIKeyMiddleware, BodySizeLimitMiddleware
from pagoda.entrypoints.openai.pooling_routes import POOLING_ROUTES, PoolingRoute, validate_body
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelActionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from pagoda.entrypoints.openai.server_args import ServerArgs
from pagoda.entrypoints.openai.serving_chat import chat_prompt_async, create_chat_completion
from pagoda.entrypoints.openai.model_pool import ModelLeaseMiddleware, ModelPool, ModelSpec
from pagoda.entrypoints.openai.serving_common import ServingContext, request_context
from pagoda.entrypoints.openai.serving_completion import create_completion
from pagoda.entrypoints.openai.lora_modules import LoRAModulePath
from pagoda.entrypoints.openai.serving_models import ServingModels
from pagoda.entrypoints.openai.serving_pooling import require_generate
from pagoda.entrypoints.openai.serving_responses import add_responses_routes
from pagoda.entrypoints.openai.tokenizer_info import tokenizer_info
from pagoda.entrypoints.openai.tool_calls import resolve_tool_parser
from pagoda.model_loader import ModelLoadError
from pagoda.metrics.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagoda.metrics.prometheus import PrometheusStatLogger
from pagoda.multimodal.media import MediaPolicy
from pagoda.plugins.io_processors import IOProcessor, get_io_processor
from pagoda.plugins.manager import PluginError
from pagoda.version import __version__

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)

# Seconds between the server's checks that its engine core still runs.
ENGINE_WATCH_INTERVAL = 0.5

def _json_body_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """The body schema for the OpenAPI document (handlers parse bodies themselves to control the errors)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _json_object(raw_request: Request) -> dict[str, Any]:
    data = parse_json_body(await raw_request.body(), raw_request.headers.get("content-type"))
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}", 400, None)
    return data


async def _parse(raw_request: Request, model: type[B]) -> B:
    return validate_body(await _json_object(raw_request), model)


def supported_tasks(engine: AsyncLLM) -> tuple[str, ...]:
    """What the model is for, decided when it loaded (the runner: generate, or the pooling tasks)."""
    return tuple(engine.supported_tasks)


def served_names(engine_args: EngineArgs, server_args: ServerArgs) -> list[str]:
    if server_args.served_model_name:
        return list(server_args.served_model_name)
    if engine_args.served_model_name:
        return [engine_args.served_model_name]
    return [engine_args.model or "SmolLM2-135M-Instruct"]


def default_sampling(engine: AsyncLLM) -> dict[str, Any]:
    """The model's sampling defaults (generation_config), logged once as vLLM's server logs them."""
    generation = engine.config.resolved.generation
    sampling = dict(generation.sampling) if generation is not None else {}
    if sampling:
        logger.info("Using default sampling params from %s: %s", generation.origin, sampling)
    return sampling


def make_serving_context(engine: AsyncLLM, server_args: ServerArgs, model_names: list[str],
                         io_processor: IOProcessor[Any, Any] | None = None) -> ServingContext:
    """One model's context: its engine, names, limits and the server's chat and tool options."""
    ctx = ServingContext(
        engine=engine,
        served_model_names=model_names,
        max_model_len=engine.max_model_len,
        max_logprobs=engine.model_config.max_logprobs,
        max_n=server_args.max_n,
        chat_template=load_chat_template(server_args.chat_template),
        trust_request_chat_template=server_args.trust_request_chat_template,
        chat_template_render_timeout=server_args.chat_template_render_timeout,
        default_sampling=default_sampling(engine),
        supported_tasks=supported_tasks(engine),
        io_processor=io_processor,
        enable_auto_tool_choice=server_args.enable_auto_tool_choice,
        tool_parser=resolve_tool_parser(server_args.enable_auto_tool_choice, server_args.tool_call_parser,
                                        server_args.tool_parser_plugin),
        tokenize_executor=ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-tokenize"),
        media=MediaPolicy.from_model_config(engine.config.model),
    )
    mm = engine.processor.mm_processor
    if ctx.chat_template is None and mm is not None and not getattr(engine.get_tokenizer(), "chat_template", None):
        ctx.chat_template = mm.chat_template  # a checkpoint that keeps its template beside the processor
    ctx.models = ServingModels(engine, model_names, engine.model_config.model or "SmolLM2-135M-Instruct",
                               engine.max_model_len, created=ctx.created)
    return ctx


def metric_prefixes(server_args: ServerArgs) -> tuple[str, ...]:
    return ("pagoda", "vllm") if server_args.vllm_metric_names else ("pagoda",)


def build_app(engine: AsyncLLM, server_args: ServerArgs, model_names: list[str],
              io_processor: IOProcessor[Any, Any] | None = None) -> FastAPI:
    """The app; ``io_processor`` (``get_io_processor``) serves /pooling requests that carry ``data``."""
    ctx = make_serving_context(engine, server_args, model_names, io_processor)
    metrics = PrometheusStatLogger(ctx.model_name, prefixes=metric_prefixes(server_args))
    engine.add_stat_logger(metrics)
    return _create_app(server_args, metrics, ctx=ctx)


def build_pool_app(pool: ModelPool, server_args: ServerArgs, metrics: PrometheusStatLogger) -> FastAPI:
    """The app of a many-model server: every route asks ``pool`` for the context of the request's model."""
    return _create_app(server_args, metrics, pool=pool)


def _create_app(server_args: ServerArgs, metrics: PrometheusStatLogger, ctx: ServingContext | None = None,
                pool: ModelPool | None = None) -> FastAPI:
    app = FastAPI(title="pagoda OpenAI-compatible server", version=__version__)
    app.state.ctx = ctx
    app.state.pool = pool
    app.state.metrics = metrics
    created = int(time.time())
    install_error_handlers(app)

    body_components: dict[str, Any] = {}

    def route(path: str, body_model: type[BaseModel]) -> Callable[..., Any]:
        return app.api_route(path, methods=["POST"], openapi_extra=_json_body_schema(body_model, body_components))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(body_components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def query_model(raw_request: Request) -> dict[str, Any]:
        # the bodiless routes (GET /tokenizer_info, /sleep, ...) name a many-model server's model in the query
        return {"model": raw_request.query_params.get("model")}

    # -- model-independent -----------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if ctx is None:
            # many models: the server is up; each model's state (and a dead engine's error) is in /v1/models
            return Response(status_code=200)
        try:
            await ctx.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - health answers, it never raises
            return JSONResponse(error_body(f"engine unhealthy: {exc}", 503), status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        # vLLM's SageMaker-style liveness probe: /health's answer
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = ctx.models.cards() if ctx is not None else pool.cards(created)  # type: ignore[union-attr]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        # OpenAI's retrieve; ids may hold "/" (hub ids)
        for card in (await models())["data"]:
            if card["id"] == model_id:
                return card
        served = ctx.served_model_names if ctx is not None else pool.names  # type: ignore[union-attr]
        raise APIError(f"The model `{model_id}` does not exist; this server serves {served}.", 404,
                       "model", code="model_not_found")

    if pool is not None:
        # many models: load / unload on demand (behind --api-key like every /v1 path)
        @route("/v1/models/load", ModelActionRequest)
        async def load_model(raw_request: Request) -> Any:
            req = await _parse(raw_request, ModelActionRequest)
            await pool.load(req.model)
            return await retrieve_model(req.model)

        @route("/v1/models/unload", ModelActionRequest)
        async def unload_model(raw_request: Request) -> Any:
            req = await _parse(raw_request, ModelActionRequest)
            await pool.unload_named(req.model)
            return await retrieve_model(req.model)

    if envs.PAGODA_ALLOW_RUNTIME_LORA_UPDATING:
        # vLLM's rule and warning: these load files named by whoever reaches the API
        logger.warning("LoRA dynamic loading & unloading is enabled in the API server (PAGODA_ALLOW_RUNTIME_LORA_UPDATING). "
                       "This should ONLY be used for local development!")

        def lora_models() -> ServingModels:
            if ctx is None:
                raise APIError("a many-model server loads LoRA adapters from its models config (lora_modules), "
                               "not at runtime", 400, "lora_name")
            return ctx.models  # type: ignore[no-any-return]

        @route("/v1/load_lora_adapter", LoadLoRAAdapterRequest)
        async def load_lora_adapter(raw_request: Request) -> Any:
            req = await _parse(raw_request, LoadLoRAAdapterRequest)
            return PlainTextResponse(await lora_models().load_lora_adapter(req.lora_name, req.lora_path))

        @route("/v1/unload_lora_adapter", UnloadLoRAAdapterRequest)
        async def unload_lora_adapter(raw_request: Request) -> Any:
            req = await _parse(raw_request, UnloadLoRAAdapterRequest)
            return PlainTextResponse(await lora_models().unload_lora_adapter(req.lora_name))

    if envs.PAGODA_SERVER_DEV_MODE:
        # vLLM's development endpoints (VLLM_SERVER_DEV_MODE): sleep mode
        logger.warning("PAGODA_SERVER_DEV_MODE: /sleep, /wake_up and /is_sleeping are served; "
                       "this should ONLY be used for local development!")

        @app.post("/sleep")
        async def sleep(raw_request: Request) -> Response:
            level_text = raw_request.query_params.get("level", "1")
            if level_text not in ("1", "2"):
                raise APIError(f"level must be 1 or 2, got {level_text!r}", 400, "level")
            target = await request_context(raw_request, query_model(raw_request))
            try:
                await target.engine.sleep(int(level_text))
            except ValueError as exc:
                raise APIError(str(exc), 400, None) from None
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(raw_request: Request) -> Response:
            tags = raw_request.query_params.getlist("tags") or None
            target = await request_context(raw_request, query_model(raw_request))
            try:
                await target.engine.wake_up(tags)
            except ValueError as exc:
                raise APIError(str(exc), 400, "tags") from None
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping(raw_request: Request) -> dict[str, bool]:
            target = await request_context(raw_request, query_model(raw_request))
            return {"is_sleeping": await target.engine.is_sleeping()}

    if server_args.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info(raw_request: Request) -> dict[str, Any]:
            target = await request_context(raw_request, query_model(raw_request))
            return tokenizer_info(target.need_tokenizer(), target.chat_template)

    # -- generation ----------------------------------------------------------------------
    @route("/v1/completions", CompletionRequest)
    async def completions(raw_request: Request) -> Any:
        data = await _json_object(raw_request)
        target = await request_context(raw_request, data)
        require_generate(target, "/v1/completions")
        return await create_completion(target, validate_body(data, CompletionRequest), raw_request)

    @route("/v1/chat/completions", ChatCompletionRequest)
    async def chat_completions(raw_request: Request) -> Any:
        data = await _json_object(raw_request)
        target = await request_context(raw_request, data)
        require_generate(target, "/v1/chat/completions")
        return await create_chat_completion(target, validate_body(data, ChatCompletionRequest), raw_request)

    add_anthropic_routes(app, route)  # /v1/messages, /v1/messages/count_tokens

    add_responses_routes(app, server_args.responses_store_max_entries, _json_object)

    # -- tokenizer -------------------------------------------------------------------------
    @route("/tokenize", TokenizeCompletionRequest)
    async def tokenize(raw_request: Request) -> Any:
        data = parse_json_body(await raw_request.body(), raw_request.headers.get("content-type"))
        is_chat = isinstance(data, dict) and "messages" in data
        model = TokenizeChatRequest if is_chat else TokenizeCompletionRequest
        target = await request_context(raw_request, data)
        try:
            req: Any = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        target.check_model(req.model, allow_lora=True)  # an adapter shares its base model's tokenizer
        tok = target.need_tokenizer()
        if is_chat:
            _, ids = await chat_prompt_async(target, req, bounded=False)
        else:
            ids = await target.encode_unbounded(req.prompt, req.add_special_tokens)
        def render() -> bytes:
            # a 10 MB text is ~10^6 ids: their strings and the JSON are built off the loop too
            body: dict[str, Any] = {"count": len(ids), "max_model_len": target.max_model_len, "tokens": ids}
            if req.return_token_strs:
                body["token_strs"] = tok.convert_ids_to_tokens(ids)
            return json.dumps(body, ensure_ascii=False).encode()

        content = await asyncio.get_running_loop().run_in_executor(target.tokenize_executor, render)
        return Response(content, media_type="application/json")

    @route("/detokenize", DetokenizeRequest)
    async def detokenize(raw_request: Request) -> Any:
        data = await _json_object(raw_request)
        target = await request_context(raw_request, data)
        req = validate_body(data, DetokenizeRequest)
        target.check_model(req.model, allow_lora=True)
        tok = target.need_tokenizer()
        vocab = target.engine.vocab_size
        bad = [t for t in req.tokens if t < 0 or t >= vocab]
        if bad:
            raise APIError(f"token id(s) {bad[:5]} out of range [0, {vocab})", 400, "tokens")
        return {"prompt": tok.decode(req.tokens)}

    # -- pooling (each answers 404 model_not_supported when the model lacks its task) ---------------
    def pooling_endpoint(path: str, pooling_route: PoolingRoute) -> None:
        async def endpoint(raw_request: Request) -> Any:
            data = await _json_object(raw_request)
            target = await request_context(raw_request, data)
            pooling_route.check(target, path)
            return await pooling_route.handle(target, data, raw_request)

        endpoint.__name__ = "pooling_" + path.strip("/").replace("/", "_")
        route(path, pooling_route.body)(endpoint)

    for path, pooling_route in POOLING_ROUTES.items():
        pooling_endpoint(path, pooling_route)

    # outermost last: CORS answers preflights before the key check; the size cap runs before any parsing
    if pool is not None:
        app.add_middleware(ModelLeaseMiddleware, pool=pool)
    api_key = server_args.resolved_api_key()
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server_args.max_request_body_bytes)
    if "*" not in server_args.allowed_hosts:
        app.add_middleware(AllowedHostsMiddleware, allowed_hosts=server_args.allowed_hosts)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=server_args.allowed_origins,
        allow_credentials=server_args.allow_credentials,
        allow_methods=server_args.allowed_methods,
        allow_headers=server_args.allowed_headers,
    )
    return app


def _url_of(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}" if ":" not in str(host) else f"http://[{host}]:{port}"


def _uvicorn_server(app: FastAPI, server_args: ServerArgs) -> Any:
    import uvicorn

    config = uvicorn.Config(app, log_level=server_args.uvicorn_log_level, access_log=not server_args.disable_log_requests,
                            timeout_graceful_shutdown=max(1, int(server_args.shutdown_timeout)) if server_args.shutdown_timeout else None)
    return uvicorn.Server(config)


async def _announce(server: Any, what: str, url: str,
                    on_ready: Callable[[str], Awaitable[None] | None] | None) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("pagoda serves %s at %s (OpenAI API under %s/v1)", what, url, url)
    if on_ready is not None:
        result = on_ready(url)
        if asyncio.iscoroutine(result):
            await result


async def serve(engine: AsyncLLM, server_args: ServerArgs, model_names: list[str], sock: socket.socket,
                on_ready: Callable[[str], Awaitable[None] | None] | None = None,
                io_processor: IOProcessor[Any, Any] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then let in-flight requests finish for at most ``shutdown_timeout`` seconds."""
    app = build_app(engine, server_args, model_names, io_processor)
    try:
        # --lora-modules: loaded (and checked) before the first request
        await app.state.ctx.models.load_static([LoRAModulePath.parse(m) for m in server_args.lora_modules or []])
    except (APIError, ValueError) as exc:
        engine.shutdown()
        raise ModelLoadError(f"--lora-modules: {exc}") from exc
    server = _uvicorn_server(app, server_args)
    died: list[str] = []

    async def watch_engine() -> None:
        # vLLM's rule: a server whose engine died exits, so its supervisor (systemd, Kubernetes) restarts
        # it; until uvicorn has stopped, requests get 503 (the EngineDeadError handler)
        while True:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL)
            try:
                await engine.check_health()
            except Exception as exc:  # noqa: BLE001 - any failure of the core is fatal to the server
                died.append(str(exc))
                logger.error("%s; the server exits so that its supervisor can restart it", exc)
                server.should_exit = True
                return

    announcer = asyncio.create_task(_announce(server, model_names[0], _url_of(sock), on_ready))
    watcher = asyncio.create_task(watch_engine())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
        watcher.cancel()
        engine.shutdown()
    if died:
        raise EngineDeadError(died[0])


def pool_loader(server_args: ServerArgs, metrics: PrometheusStatLogger) -> Callable[[ModelSpec], Awaitable[ServingContext]]:
    """How a many-model server loads one model: its own AsyncLLM (engine core in its own process), off the loop."""

    async def load(spec: ModelSpec) -> ServingContext:
        engine_args = spec.engine_args
        if server_args.max_parked_models and not engine_args.enable_sleep_mode:
            # parking is a sleep; the flag only lifts sleep's refusal, it costs nothing while awake
            engine_args = engine_args.model_copy(update={"enable_sleep_mode": True})
        engine = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args,
                                         log_stats=not server_args.disable_log_stats, engine_core_process=True)
        try:
            io_processor = get_io_processor(engine.config, engine.model_config.io_processor_plugin)
            ctx = make_serving_context(engine, server_args, spec.served_model_names, io_processor)
            await ctx.models.load_static([LoRAModulePath.parse(m) for m in spec.lora_modules])
        except BaseException:
            await asyncio.to_thread(engine.shutdown)
            raise
        engine.add_stat_logger(metrics.for_model(ctx.model_name))
        return ctx

    return load


def spare_engine_core(waiting: list[ModelSpec]) -> None:
    """A standby engine core for the next of ``waiting`` to load (``ModelPool``'s spare), if one would take it."""
    from pagoda.engine.core_process import standby_config_imports, start_standby_core
    from pagoda.engine.mp_client import engine_core_in_process

    try:
        in_processes = [s.engine_args for s in waiting
                        if engine_core_in_process(s.engine_args.world_size, s.engine_args.data_parallel_size, True)]
    except ValueError:
        return  # a malformed PAGODA_ENABLE_V1_MULTIPROCESSING: the load itself reports it
    if in_processes:
        # the next load may be any of them: each GGUF file's cache is looked at in the core
        wanted = {standby_config_imports(a.model, a.model_impl) for a in in_processes}
        start_standby_core(config_imports=True if True in wanted or len(wanted) > 1 else wanted.pop())


async def serve_pool(specs: list[ModelSpec], server_args: ServerArgs, sock: socket.socket,
                     on_ready: Callable[[str], Awaitable[None] | None] | None = None) -> None:
    """Serve several models on one port (each loaded on its first request) until SIGINT/SIGTERM."""
    metrics = PrometheusStatLogger(specs[0].served_model_names[0], prefixes=metric_prefixes(server_args))
    pool = ModelPool(specs, pool_loader(server_args, metrics), max_loaded_models=server_args.max_loaded_models,
                     memory_budget_bytes=server_args.models_memory_budget,
                     idle_timeout_s=server_args.model_idle_timeout, load_timeout_s=server_args.model_load_timeout,
                     max_parked_models=server_args.max_parked_models, spare_core=spare_engine_core)
    app = build_pool_app(pool, server_args, metrics)
    server = _uvicorn_server(app, server_args)
    announcer = asyncio.create_task(_announce(server, f"{len(specs)} models ({', '.join(pool.names)})",
                                              _url_of(sock), on_ready))
    pool.start()
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
        await pool.shutdown()


def _run_pool(models: list[ModelSpec], server_args: ServerArgs, sock: socket.socket, started: float) -> None:
    def on_ready(url: str) -> None:
        logger.info("ready in %.1f s since start; models load on their first request", time.perf_counter() - started)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(serve_pool(models, server_args, sock, on_ready))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_server(engine_args: EngineArgs, server_args: ServerArgs, sock: socket.socket | None = None,
               started: float | None = None, models: list[ModelSpec] | None = None) -> None:
    """Bind (unless ``sock`` is the listening socket already), load the model, serve; blocks until
    stopped (the body of `pagoda serve`). ``started``: the ``time.perf_counter()`` the start is timed from.
    ``models``: serve these (many models on one port, each loaded on its first request) instead."""
    started = time.perf_counter() if started is None else started
    # SIGTERM's default action ends the process on the spot, skipping every finally and atexit (the
    # engine-core client's socket directory stayed in the temp dir); uvicorn also re-raises a captured
    # SIGTERM once it has drained. As SystemExit it unwinds like SIGINT does.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        # a parser nobody provides stops the start before the model loads
        resolve_tool_parser(server_args.enable_auto_tool_choice, server_args.tool_call_parser,
                            server_args.tool_parser_plugin)
    except (ValueError, OSError, ImportError) as exc:
        if sock is not None:
            sock.close()
        raise PluginError(str(exc)) from exc
    if sock is None:
        sock = bind_socket(server_args.host, server_args.port, server_args.uds)
    if models is not None:
        _run_pool(models, server_args, sock, started)
        return
    # The engine core in its own process, as vLLM's server runs it: W3 on 2 Zen 5 cores measured
    # 1.10-1.21x the thread's output tok/s (docs/benchmarks.md, session 10);
    # PAGODA_ENABLE_V1_MULTIPROCESSING=0 keeps it in a thread of this process.
    engine = AsyncLLM.from_engine_args(engine_args, log_stats=not server_args.disable_log_stats,
                                       engine_core_process=True)
    try:
        # before serving: a processor nobody provides stops the start (PluginError)
        io_processor = get_io_processor(engine.config, engine.model_config.io_processor_plugin)
    except BaseException:
        engine.shutdown()
        sock.close()
        raise
    names = served_names(engine_args, server_args)
    logger.info("model loaded in %.1f s", time.perf_counter() - started)

    def on_ready(url: str) -> None:
        logger.info("ready in %.1f s since start", time.perf_counter() - started)

    # uvicorn installs its own SIGINT/SIGTERM handlers (graceful drain); restore ours afterwards
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(serve(engine, server_args, names, sock, on_ready, io_processor))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()


if __name__ == "__main__":
    # vLLM's `python -m vllm.entrypoints.openai.api_server`: `pagoda serve` under that name
    from pagoda.entrypoints.cli.serve_cmd import api_server_main

    api_server_main()
