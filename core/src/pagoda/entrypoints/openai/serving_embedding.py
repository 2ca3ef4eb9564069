"""POST /v1/embeddings, /pooling (the pooler's raw output, or an IO processor plugin's request) and /classify."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    IOProcessorRequest,
    PoolingChatRequest,
    PoolingCompletionRequest,
)
from pagoda.entrypoints.openai.serving_common import ServingContext, new_id
from pagoda.entrypoints.openai.serving_pooling import (
    chat_input_prompt,
    default_pooling_task,
    encode_pooled,
    indexed,
    input_prompts,
    pooled_data,
    pooling_params,
    pooling_usage,
    require_task,
    run_pooling,
)
from pagoda.pooling_params import PoolingParams


def _prompts(ctx: ServingContext, req: Any) -> list[dict[str, Any]]:
    if hasattr(req, "messages"):
        return [chat_input_prompt(ctx, req, req.truncate_prompt_tokens)]
    return input_prompts(ctx, req.input, req.add_special_tokens, req.truncate_prompt_tokens)


async def create_embedding(ctx: ServingContext, req: EmbeddingCompletionRequest | EmbeddingChatRequest,
                           raw_request: Request) -> dict[str, Any]:
    ctx.check_model(req.model)
    require_task(ctx, "/v1/embeddings", "embed")
    prompts = await ctx.engine.run_prep(_prompts, ctx, req)  # tokenizing: off the event loop
    params = pooling_params(task="embed", dimensions=req.dimensions, normalize=req.normalize,
                            truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = req.request_id or new_id("embd")
    outputs = await run_pooling(ctx, raw_request, prompts, params, request_id, req.priority)
    data = [{"index": i, "object": "embedding", "embedding": encode_pooled(pooled_data(o), req.encoding_format)}
            for i, o in enumerate(outputs)]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.model_name,
            "data": data, "usage": pooling_usage(outputs)}


async def create_pooling(ctx: ServingContext, req: PoolingCompletionRequest | PoolingChatRequest,
                         raw_request: Request) -> dict[str, Any]:
    ctx.check_model(req.model)
    task = req.task or default_pooling_task(ctx)
    # "encode" is the generic per-token task: the model's token_embed or token_classify
    require_task(ctx, "/pooling", *(("encode", "token_embed", "token_classify") if task == "encode" else (task or "embed",)))
    prompts = await ctx.engine.run_prep(_prompts, ctx, req)  # tokenizing: off the event loop
    params = pooling_params(task=task, dimensions=req.dimensions, normalize=req.normalize,
                            use_activation=req.use_activation, truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = req.request_id or new_id("pool")
    outputs = await run_pooling(ctx, raw_request, prompts, params, request_id, req.priority)
    data = [{"index": i, "object": "pooling", "data": encode_pooled(pooled_data(o), req.encoding_format)}
            for i, o in enumerate(outputs)]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.model_name,
            "data": data, "usage": pooling_usage(outputs)}


def _as_prompt_list(prompts: Any) -> list[Any]:
    """A plugin's pre_process may return one prompt (text, dict, token ids) or a sequence of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise APIError(f"the IO processor's pre_process returned {type(prompts).__name__}, not a prompt or a list of "
                   "prompts", 500)


async def create_io_processor_pooling(ctx: ServingContext, req: IOProcessorRequest, raw_request: Request) -> Any:
    """vLLM's plugin flow: parse_request -> pre_process -> encode each prompt -> post_process -> output_to_response."""
    ctx.check_model(req.model)
    processor = ctx.io_processor
    if processor is None:
        raise APIError("This request has 'data', which is for an IO processor plugin, and the server runs none: start it "
                       "with --io-processor-plugin NAME (see `pagoda plugins list`), or send 'input' or 'messages'.",
                       400, "data")
    request_id = req.request_id or new_id("pool")
    with _plugin_errors("refused the request", 400):
        validated = processor.parse_request(req)
        prompts = _as_prompt_list(await processor.pre_process_async(validated, request_id=request_id))
    if not prompts:
        raise APIError("the IO processor made no prompt of this request", 400, "data")
    with _plugin_errors("could not choose the pooling params", 500):
        params = processor.validate_or_generate_params()
    if not isinstance(params, PoolingParams):
        raise APIError(f"the IO processor's validate_or_generate_params returned {type(params).__name__}, not "
                       "PoolingParams", 500)
    if params.task is None:
        params = params.clone()
        params.task = default_pooling_task(ctx)  # type: ignore[assignment]
    outputs = await run_pooling(ctx, raw_request, prompts, params, request_id, req.priority)
    with _plugin_errors("could not build the response", 500):
        plugin_output = await processor.post_process_async(indexed(outputs), request_id=request_id)
        response = processor.output_to_response(plugin_output)
        if response.request_id is None:
            response.request_id = request_id
        return response.model_dump(mode="json")


@contextmanager
def _plugin_errors(what: str, status: int) -> Iterator[None]:
    """A plugin's failure as an OpenAI-style error: its ValueError / TypeError with ``status`` (bad data on the way
    in is the client's 400), anything else a 500; never an unformatted server error."""
    try:
        yield
    except APIError:
        raise
    except (ValueError, TypeError) as exc:
        raise APIError(f"the IO processor {what}: {exc}", status, "data" if status < 500 else None) from None
    except Exception as exc:  # noqa: BLE001 - third-party code: reported, never raised through the server
        raise APIError(f"the IO processor {what}: {type(exc).__name__}: {exc}", 500) from None


async def create_classify(ctx: ServingContext, req: ClassificationRequest, raw_request: Request) -> dict[str, Any]:
    ctx.check_model(req.model)
    require_task(ctx, "/classify", "classify")
    prompts = await ctx.engine.run_prep(input_prompts, ctx, req.input, req.add_special_tokens, req.truncate_prompt_tokens)
    params = pooling_params(task="classify", use_activation=req.use_activation,
                            truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = req.request_id or new_id("classify")
    outputs = await run_pooling(ctx, raw_request, prompts, params, request_id, req.priority)
    id2label = _id2label(ctx)
    data = []
    for i, o in enumerate(outputs):
        probs = pooled_data(o).flatten()
        best = int(probs.argmax()) if probs.numel() else 0
        data.append({"index": i, "label": id2label.get(best), "probs": probs.tolist(), "num_classes": probs.numel()})
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.model_name,
            "data": data, "usage": pooling_usage(outputs)}


def _id2label(ctx: ServingContext) -> dict[int, str]:
    config = ctx.engine.config.resolved.hf_config
    return {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
