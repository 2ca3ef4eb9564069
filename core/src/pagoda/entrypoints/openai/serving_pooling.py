"""What the pooling endpoints share: the model's tasks, prompts from ``input``, running pooling requests, encoding.

A pooling request is prefill only: each prompt becomes one engine request that
ends with one ``PoolingRequestOutput`` (``AsyncLLM.encode``). Prompts are
tokenized here, as for completions, so that usage counts, truncation and the
length check happen before the engine sees anything; the engine's own input
checks (token ids in range, the pooling params against the model) raise
ValueError, answered with a 400. Every prompt of a request is queued at once,
and a client that goes away aborts all of them.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from fastapi import Request

from pagoda.engine.async_llm import EngineDeadError, EngineGenerateError
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.serving_common import ServingContext, until_disconnected
from pagoda.pooling_params import PoolingParams

# The task /pooling runs when a request names none: the first the model supports, in this order.
_DEFAULT_TASK_ORDER = ("embed", "classify", "score", "token_embed", "token_classify", "encode")
POOLING_TASKS = frozenset(_DEFAULT_TASK_ORDER)


def describe_tasks(tasks: Sequence[str]) -> str:
    return ", ".join(tasks) if tasks else "none"


def is_pooling_model(ctx: ServingContext) -> bool:
    return any(t in POOLING_TASKS for t in ctx.supported_tasks)


def default_pooling_task(ctx: ServingContext) -> str | None:
    return next((t for t in _DEFAULT_TASK_ORDER if t in ctx.supported_tasks), None)


def require_task(ctx: ServingContext, path: str, *tasks: str) -> str:
    """The first of ``tasks`` the model supports; else a 404 naming what the model is for."""
    for task in tasks:
        if task in ctx.supported_tasks:
            return task
    if not is_pooling_model(ctx):
        message = (f"The model `{ctx.model_name}` does not support {path}: it is a generative model; pooling endpoints "
                   "(embeddings, pooling, classify, score, rerank) need a pooling model.")
    else:
        message = (f"The model `{ctx.model_name}` does not support {path}: it needs the task "
                   f"{' or '.join(repr(t) for t in tasks)}, and this model supports {describe_tasks(ctx.supported_tasks)}.")
    raise APIError(message, 404, None, code="model_not_supported")


def require_generate(ctx: ServingContext, path: str) -> None:
    """Generation endpoints on a pooling model: a 404 that says what the model is for."""
    if "generate" not in ctx.supported_tasks:
        raise APIError(
            f"The model `{ctx.model_name}` does not support {path}: it is a pooling model (tasks: "
            f"{describe_tasks(ctx.supported_tasks)}); use /v1/embeddings, /pooling, /classify, /score or /rerank, "
            "or serve a generative model.", 404, None, code="model_not_supported")


# -- prompts ------------------------------------------------------------------------------------------


def truncation_length(ctx: ServingContext, truncate_prompt_tokens: int | None) -> int | None:
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return ctx.max_model_len
    if truncate_prompt_tokens > ctx.max_model_len:
        raise APIError(f"truncate_prompt_tokens={truncate_prompt_tokens} is larger than this model's maximum context "
                       f"length of {ctx.max_model_len} tokens", 400, "truncate_prompt_tokens")
    return truncate_prompt_tokens


def tokenize_text(ctx: ServingContext, text: str, add_special_tokens: bool, truncate: int | None) -> list[int]:
    tok = ctx.need_tokenizer()
    if truncate is None:
        ids: list[int] = tok(text, add_special_tokens=add_special_tokens).input_ids
        return ids
    # as vLLM: the tokenizer truncates text (its side, special tokens kept)
    ids = tok(text, add_special_tokens=add_special_tokens, truncation=True, max_length=truncate).input_ids
    return ids


def input_prompts(ctx: ServingContext, value: Any, add_special_tokens: bool, truncate_prompt_tokens: int | None,
                  param: str = "input") -> list[dict[str, Any]]:
    """Engine prompts for the four ``input`` shapes (a string, strings, token ids, lists of token ids).

    Texts go to the engine as text, so it tokenizes them as ``LLM.embed`` does (the model's
    ``do_lower_case``, truncation by ``PoolingParams.truncate_prompt_tokens``); only
    ``add_special_tokens=false`` is tokenized here.
    """
    truncate = truncation_length(ctx, truncate_prompt_tokens)
    if isinstance(value, str):
        items: list[Any] = [value]
    elif not value:
        raise APIError(f"{param} must not be empty", 400, param)
    elif all(isinstance(x, int) for x in value):
        items = [list(value)]
    else:
        items = list(value)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = param if len(items) == 1 else f"{param}[{i}]"
        if isinstance(item, str):
            if add_special_tokens:
                out.append({"prompt": item})
                continue
            ids = tokenize_text(ctx, item, False, truncate)
            out.append(engine_prompt(item, ids))
        else:
            if not item:
                raise APIError(f"{where}: a token id list must not be empty", 400, param)
            # as vLLM: token ids keep their last ``truncate`` tokens
            ids = list(item)[-truncate:] if truncate is not None else list(item)
            out.append(engine_prompt(None, ids))
        check_pooling_length(ctx, len(ids), where)
    return out


def chat_input_prompt(ctx: ServingContext, req: Any, truncate_prompt_tokens: int | None) -> dict[str, Any]:
    """A conversation rendered with the chat template, then tokenized (truncated as text is)."""
    from pagoda.entrypoints.openai.serving_chat import chat_prompt

    text, ids = chat_prompt(ctx, req)
    truncate = truncation_length(ctx, truncate_prompt_tokens)
    if truncate is not None:
        ids = tokenize_text(ctx, text, req.add_special_tokens, truncate)
    check_pooling_length(ctx, len(ids), "messages")
    return engine_prompt(text, ids)


def check_pooling_length(ctx: ServingContext, num_tokens: int, param: str) -> None:
    # a pooling request generates nothing: the whole context is the prompt's
    if num_tokens > ctx.max_model_len:
        raise APIError(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested {num_tokens} "
            "tokens in the input for pooling. Please reduce the length of the input, or set truncate_prompt_tokens.",
            400, param,
        )


def engine_prompt(text: str | None, ids: list[int], **extra: Any) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": ids, **extra}
    if text is not None:
        prompt["prompt"] = text
    return prompt


def pooling_params(**fields: Any) -> PoolingParams:
    """``PoolingParams`` from the request's fields; one the engine refuses is the client's 400."""
    try:
        return PoolingParams(**{k: v for k, v in fields.items() if v is not None})
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), 400, _param_of(str(exc), fields)) from None


def _param_of(message: str, fields: dict[str, Any]) -> str | None:
    return next((name for name in fields if name in message), None)


# -- running --------------------------------------------------------------------------------------------


async def run_pooling(ctx: ServingContext, raw_request: Request, prompts: Sequence[Any],
                      params: PoolingParams | Sequence[PoolingParams], request_id: str, priority: int,
                      input_name: str = "input") -> list[Any]:
    """Each prompt's final ``PoolingRequestOutput``, in prompt order; all of them aborted however this ends early."""
    params_list = [params] * len(prompts) if isinstance(params, PoolingParams) else list(params)

    async def one(i: int) -> Any:
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        final = None
        try:
            async for out in ctx.engine.encode(prompts[i], params_list[i], rid, priority=priority):
                final = out
        except ValueError as exc:
            # which of several inputs the engine refused
            raise ValueError(str(exc) if len(prompts) == 1 else f"{input_name}[{i}]: {exc}") from None
        if final is None:
            raise EngineGenerateError(f"request {rid} ended without an output")
        return final

    async def run_all() -> list[Any]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            # one prompt failing (bad input) or the client leaving: the others' requests are aborted
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        return await until_disconnected(raw_request, run_all())
    except ValueError as exc:
        message = str(exc)
        raise APIError(message, 400, _engine_param(message, input_name)) from None
    except EngineDeadError as exc:
        raise APIError(f"the engine is not running: {exc}", 503) from None
    except EngineGenerateError as exc:
        raise APIError(f"internal engine error: {exc}", 500) from None


# PoolingParams' checks name these; any other refusal is about the prompt
_POOLING_PARAM_NAMES = ("dimensions", "normalize", "use_activation")


def _engine_param(message: str, input_name: str) -> str:
    if "matryoshka" in message:
        return "dimensions"
    # PoolingParams.verify: "Task X only supports [...] parameters, does not support [...] parameters"
    if "parameters, does not support" in message:
        at_fault = message.rpartition("does not support")[2]
        return next((name for name in _POOLING_PARAM_NAMES if name in at_fault), input_name)
    return input_name


async def indexed(outputs: Sequence[Any]) -> AsyncIterator[tuple[int, Any]]:
    """Outputs as the (prompt index, output) stream that ``IOProcessor.post_process_async`` reads."""
    for i, out in enumerate(outputs):
        yield i, out


# -- encoding -------------------------------------------------------------------------------------------


def pooled_data(output: Any) -> Any:
    """The pooled tensor of a ``PoolingRequestOutput``, as float32 on the host."""
    import torch

    data = output.outputs.data
    tensor = data if isinstance(data, torch.Tensor) else torch.as_tensor(data)
    return tensor.detach().to("cpu", torch.float32)


def encode_pooled(data: Any, encoding_format: str) -> Any:
    """float: (nested) lists of numbers; base64: the float32 little-endian bytes, as the OpenAI SDK decodes them."""
    if encoding_format == "base64":
        array = np.ascontiguousarray(data.numpy(), dtype="<f4")
        return base64.b64encode(array.tobytes()).decode("ascii")
    return data.tolist()


def pooling_usage(outputs: Sequence[Any]) -> dict[str, int]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
