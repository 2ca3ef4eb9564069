"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.logprobs_format import CompletionLogprobs, TokenText
from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.serving_common import (
    PredictionUsage,
    ServingContext,
    build_sampling_params,
    check_limits,
    check_prompt_length,
    collect_finals,
    default_max_tokens,
    merge_streams,
    new_id,
    prediction_prompt,
    sse,
    sse_response_body,
    start_streams,
    usage,
)
from pagoda.outputs import RequestOutput


async def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """-> [(prompt text or None, token ids)] for the four prompt shapes."""
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif not p:
        raise APIError("prompt must not be empty", 400, "prompt")
    elif all(isinstance(x, int) for x in p):
        items = [list(p)]
    else:
        items = list(p)
    out: list[tuple[str | None, list[int]]] = []
    for item in items:
        if isinstance(item, str):
            if req.truncate_prompt_tokens is not None:
                # the prompt's end is kept: it is tokenized whole
                tok, special = ctx.need_tokenizer(), req.add_special_tokens
                ids = await ctx.engine.run_prep(lambda t=item, tk=tok: tk(t, add_special_tokens=special).input_ids)
            else:
                ids = await ctx.encode(item, req.add_special_tokens, "prompt")
            out.append((item, list(ids)))
        else:
            if not item:
                raise APIError("prompt token lists must not be empty", 400, "prompt")
            out.append((None, list(item)))
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw_request: Request) -> Any:
    lora_request = await ctx.resolve_model(req.model)
    if req.suffix is not None:
        raise APIError("suffix is not supported: this server does not do fill-in-the-middle completions", 400, "suffix")
    check_limits(ctx, req, req.logprobs)
    prompts = await _prompts(ctx, req)
    requested = req.max_tokens
    if "max_tokens" in ctx.default_sampling:
        # the model's max_new_tokens, capped by the shortest prompt's room, caps (or stands in for) the
        # request's max_tokens, as in vLLM
        default = min(default_max_tokens(ctx, len(ids)) or 1 for _, ids in prompts)
        requested = default if "max_tokens" not in req.model_fields_set or requested is None else min(requested, default)
    max_tokens = min(check_prompt_length(ctx, len(ids), requested, "prompt") for _, ids in prompts)
    if requested is None:
        max_tokens = None  # type: ignore[assignment]  # each prompt gets the rest of its context
    params = build_sampling_params(req, max_tokens, req.logprobs, req.stream, ctx.default_sampling)
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = max(params.prompt_logprobs or 0, req.logprobs)
    request_id = new_id("cmpl") if req.request_id is None else req.request_id
    engine_prompts = [{"prompt_token_ids": ids, **({"prompt": text} if text is not None else {})} for text, ids in prompts]
    if req.cache_salt is not None:
        for ep in engine_prompts:
            ep["cache_salt"] = req.cache_salt
    for ep in engine_prompts:
        await prediction_prompt(ctx, ep, req.prediction)
    streams = await start_streams(ctx, engine_prompts, params, request_id, req.priority, lora_request)
    created = int(time.time())
    renderer = _Renderer(ctx, req, prompts)
    if req.stream:
        events = _events(ctx, req, streams, request_id, created, renderer)
        return StreamingResponse(sse_response_body(streams, events), media_type="text/event-stream")
    finals: dict[int, RequestOutput] = await collect_finals(raw_request, streams)
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    predicted = PredictionUsage(req.prediction is not None)
    for i in range(len(prompts)):
        ro = finals[i]
        for o in ro.outputs:
            completion_tokens += len(o.token_ids)
            predicted.observe(i * req.n + o.index, o)
            choices.append(renderer.choice(i, o, ro, first=True, final=True))
    choices.sort(key=lambda c: c["index"])
    body = {
        "id": request_id, "object": "text_completion", "created": created, "model": ctx.response_model(req.model),
        "choices": choices, "usage": usage(sum(len(ids) for _, ids in prompts), completion_tokens, predicted),
        "system_fingerprint": None,
    }
    return JSONResponse(body)


class _Renderer:
    """One choice's text and logprobs, for the whole answer or for one streamed delta."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[tuple[str | None, list[int]]]) -> None:
        self.req = req
        self.n = req.n
        self.prompts = prompts
        self.token_text = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
        self.tokenizer = ctx.tokenizer
        self.lp_state: dict[int, CompletionLogprobs] = {}

    def _prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        if text is not None:
            return text
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def choice(self, prompt_index: int, o: Any, ro: RequestOutput, first: bool, final: bool) -> dict[str, Any]:
        index = prompt_index * self.n + o.index
        text = o.text
        logprobs: dict[str, list[Any]] | None = None
        echo = self.req.echo and first
        if echo:
            text = self._prompt_text(prompt_index) + text
        if self.req.logprobs is not None:
            state = self.lp_state.setdefault(index, CompletionLogprobs(self.token_text, self.req.logprobs))
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if echo:
                _, ids = self.prompts[prompt_index]
                part = state.build(ids, ro.prompt_logprobs)
                for k in logprobs:
                    logprobs[k].extend(part[k])
            part = state.build(list(o.token_ids), o.logprobs)
            for k in logprobs:
                logprobs[k].extend(part[k])
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason if final or o.finish_reason else None,
                "stop_reason": o.stop_reason}


async def _events(ctx: ServingContext, req: CompletionRequest, streams: list[Any], request_id: str, created: int,
                  renderer: _Renderer) -> AsyncGenerator[str, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    prompt_tokens = sum(len(ids) for _, ids in renderer.prompts)
    completion_tokens = 0
    predicted = PredictionUsage(req.prediction is not None)
    started: set[int] = set()
    async for i, ro in merge_streams(streams):
        for o in ro.outputs:
            index = i * req.n + o.index
            predicted.observe(index, o)
            first = index not in started
            if not o.token_ids and not o.text and o.finish_reason is None and not first:
                continue
            started.add(index)
            completion_tokens += len(o.token_ids)
            chunk: dict[str, Any] = {
                "id": request_id, "object": "text_completion", "created": created, "model": ctx.response_model(req.model),
                "choices": [renderer.choice(i, o, ro, first=first, final=o.finish_reason is not None)],
            }
            if include_usage and continuous:
                chunk["usage"] = usage(prompt_tokens, completion_tokens, predicted)
            yield sse(chunk)
    if include_usage:
        yield sse({"id": request_id, "object": "text_completion", "created": created, "model": ctx.response_model(req.model),
                   "choices": [], "usage": usage(prompt_tokens, completion_tokens, predicted)})
