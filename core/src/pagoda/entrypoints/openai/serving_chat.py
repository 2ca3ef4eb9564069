"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.entrypoints.chat_utils import extract_images
from pagoda.entrypoints.openai.chat_template import message_dicts, render_chat
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.logprobs_format import TokenText, chat_logprobs, prompt_logprobs_json
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ImageURLContentPart, TextContentPart
from pagoda.entrypoints.openai.reasoning import ChatReasoning, chat_reasoning, reasoning_fields
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
from pagoda.entrypoints.openai.tool_calls import ChatToolCalls, ChoiceToolCalls, prepare_tool_calls
from pagoda.outputs import CompletionOutput
from pagoda.sampling_params import SamplingParams


def _render(ctx: ServingContext, req: Any, messages: list[dict[str, Any]] | None = None) -> str:
    return render_chat(
        ctx.need_tokenizer(), req.messages if messages is None else messages,
        request_template=req.chat_template, server_template=ctx.chat_template,
        template_kwargs=req.template_kwargs(),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, tools=req.tools,
        documents=getattr(req, "documents", None),
        trust_request_template=ctx.trust_request_chat_template, timeout=ctx.chat_template_render_timeout,
    )


def chat_prompt(ctx: ServingContext, req: Any) -> tuple[str, list[int]]:
    """Render and tokenize the conversation on the calling thread (the render is still bounded by the timeout)."""
    text = _render(ctx, req)
    # the template already wrote the special tokens it wants
    return text, ctx.need_tokenizer()(text, add_special_tokens=req.add_special_tokens).input_ids


async def chat_prompt_async(ctx: ServingContext, req: Any, bounded: bool = True) -> tuple[str, list[int]]:
    """``chat_prompt`` with the template rendered in a worker thread, so a slow template never holds the event
    loop, and the text tokenized on the engine's preparation thread (``bounded``: a conversation far over the
    context is refused after a prefix; /tokenize counts any length)."""
    text = await asyncio.to_thread(_render, ctx, req)
    if bounded:
        return text, await ctx.encode(text, req.add_special_tokens, "messages")
    return text, await ctx.encode_unbounded(text, req.add_special_tokens)


def has_image_parts(req: Any) -> bool:
    return any(isinstance(m.content, list) and any(isinstance(p, ImageURLContentPart) for p in m.content)
               for m in req.messages)


async def mm_chat_prompt(ctx: ServingContext, req: Any) -> tuple[str, list[int], dict[str, Any]]:
    """A conversation with images -> (its text, its token ids with the placeholders expanded, the prompt).

    The images are read (and fetched, where the media policy allows it) off the event loop; a refused or
    broken one, or a text-only model, is a 400 naming ``messages``."""
    mm = ctx.engine.processor.mm_processor
    load_image = ctx.media.load_image if mm is not None else None
    try:
        messages, images = await asyncio.to_thread(extract_images, message_dicts(req.messages), load_image)
    except ValueError as exc:
        raise APIError(str(exc), 400, "messages") from None
    text = await asyncio.to_thread(_render, ctx, req, messages)
    assert mm is not None  # extract_images refused the images of a text-only model
    kwargs = {"add_special_tokens": req.add_special_tokens}
    try:
        # processed once here for the prompt's length; the engine's processor finds it in its cache
        ids, _ = await ctx.engine.run_prep(mm.process, text, {"image": images}, kwargs)
    except ValueError as exc:
        raise APIError(str(exc), 400, "messages") from None
    return text, ids, {"prompt": text, "multi_modal_data": {"image": images}, "mm_processor_kwargs": kwargs}


@dataclass
class ChatGeneration:
    """A chat request made ready for the engine: ``request`` as the tool parser adjusted it, its rendered
    prompt, sampling params (with any tool-call constraint) and the engine prompt."""

    request: ChatCompletionRequest
    tool_calls: ChatToolCalls
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: dict[str, Any]


async def prepare_chat_generation(ctx: ServingContext, req: ChatCompletionRequest, num_logprobs: int | None,
                                  prompt_param: str = "messages",
                                  max_tokens_param: str = "max_completion_tokens") -> ChatGeneration:
    """Everything before the engine, shared by the APIs that generate as chat does (``*_param``: the names the
    caller's body gives the conversation and the output bound, for the 400s)."""
    check_limits(ctx, req, num_logprobs)
    tool_calls = prepare_tool_calls(ctx, req)
    req = tool_calls.request  # an auto tool parser may need it generated differently
    prompt: dict[str, Any]
    if has_image_parts(req):
        text, ids, prompt = await mm_chat_prompt(ctx, req)
    else:
        text, ids = await chat_prompt_async(ctx, req)
        prompt = {"prompt": text, "prompt_token_ids": ids}
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = check_prompt_length(ctx, len(ids), requested,
                                     max_tokens_param if req.max_completion_tokens is not None else prompt_param)
    default = default_max_tokens(ctx, len(ids))
    if default is not None:
        # as vLLM: the model's max_new_tokens caps an explicit max_tokens too
        max_tokens = default if requested is None else min(max_tokens, default)
    params = tool_calls.constrain(build_sampling_params(req, max_tokens, num_logprobs, req.stream,
                                                        ctx.default_sampling))
    if req.cache_salt is not None:
        prompt["cache_salt"] = req.cache_salt
    await prediction_prompt(ctx, prompt, req.prediction)
    return ChatGeneration(req, tool_calls, text, ids, params, prompt)


def choice_message(tools: ChoiceToolCalls, splitter: ChatReasoning | None, text: str,
                   engine_finish_reason: str | None) -> tuple[str | None, dict[str, Any], str | None]:
    """A finished choice's (reasoning_content, message fields content/tool_calls, finish_reason)."""
    # the reasoning comes off first; tool calls are read from the answer after it
    reasoning_content, answer = splitter.split(text) if splitter is not None else (None, text)
    message, finish_reason = tools.message(answer or "", engine_finish_reason)
    if answer is None and message.get("content") == "":
        message["content"] = None  # still reasoning when it stopped: no answer
    return reasoning_content, message, finish_reason


def choice_delta(tools: ChoiceToolCalls, splitter: ChatReasoning | None, o: CompletionOutput) -> dict[str, Any]:
    """The chat delta one streamed step of a choice adds: content, reasoning_content, tool_calls ({} when
    nothing can be sent yet)."""
    finished = o.finish_reason is not None
    if splitter is None:
        return tools.delta(o.text, o.token_ids, finished)
    thought, answer = splitter.delta(o.text, o.token_ids)
    delta = tools.delta(answer or "", o.token_ids if answer else [], finished) if answer or finished else {}
    if thought:
        delta = {**reasoning_fields(thought), **delta}
    return delta


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw_request: Request) -> Any:
    lora_request = await ctx.resolve_model(req.model)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    generation = await prepare_chat_generation(ctx, req, num_logprobs)
    req, tool_calls, ids = generation.request, generation.tool_calls, generation.prompt_ids
    request_id = new_id("chatcmpl") if req.request_id is None else req.request_id
    streams = await start_streams(ctx, [generation.prompt], generation.params, request_id, req.priority,
                                  lora_request)
    created = int(time.time())
    token_text = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
    echo_text = ""
    if req.echo and req.messages[-1].role == "assistant":
        last = req.messages[-1].content
        echo_text = last if isinstance(last, str) else "\n".join(p.text for p in last or []
                                                                  if isinstance(p, TextContentPart))
    if req.stream:
        events = _events(ctx, req, streams, request_id, created, len(ids), token_text, num_logprobs, echo_text,
                         tool_calls, [chat_reasoning(ctx, req, ids) for _ in range(req.n)])
        return StreamingResponse(sse_response_body(streams, events), media_type="text/event-stream")
    ro = (await collect_finals(raw_request, streams))[0]
    choices = []
    completion_tokens = 0
    predicted = PredictionUsage(req.prediction is not None)
    for o in sorted(ro.outputs, key=lambda o: o.index):
        completion_tokens += len(o.token_ids)
        predicted.observe(o.index, o)
        reasoning_content, message, finish_reason = choice_message(tool_calls.choice(), chat_reasoning(ctx, req, ids),
                                                                   o.text, o.finish_reason)
        if echo_text and message["content"] is not None:
            message["content"] = echo_text + message["content"]
        choices.append({
            "index": o.index,
            "message": {"role": "assistant", **message, **reasoning_fields(reasoning_content)},
            "logprobs": chat_logprobs(token_text, list(o.token_ids), o.logprobs, num_logprobs)
            if num_logprobs is not None else None,
            "finish_reason": finish_reason,
            "stop_reason": o.stop_reason,
        })
    body = {
        "id": request_id, "object": "chat.completion", "created": created, "model": ctx.response_model(req.model),
        "choices": choices, "usage": usage(len(ids), completion_tokens, predicted), "system_fingerprint": None,
        "prompt_logprobs": prompt_logprobs_json(token_text, ro.prompt_logprobs) if req.prompt_logprobs is not None
        else None,
    }
    return JSONResponse(body)


async def _events(ctx: ServingContext, req: ChatCompletionRequest, streams: list[Any], request_id: str, created: int,
                  prompt_tokens: int, token_text: TokenText, num_logprobs: int | None,
                  echo_text: str, tool_calls: ChatToolCalls,
                  choice_reasoning: list[ChatReasoning | None]) -> AsyncGenerator[str, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    completion_tokens = 0
    predicted = PredictionUsage(req.prediction is not None)

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": ctx.response_model(req.model), "choices": choices}
        if include_usage and continuous:
            c["usage"] = usage(prompt_tokens, completion_tokens, predicted)
        return c

    # the role goes first, once per choice, before any token is ready (as OpenAI does)
    choice_tools = [tool_calls.choice() for _ in range(req.n)]
    for i in range(req.n):
        yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": echo_text}, "logprobs": None,
                          "finish_reason": None}]))
        # a named function's call opens before its arguments (OpenAI's first tool-call delta)
        opening = choice_tools[i].start()
        if opening:
            yield sse(chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}]))
    async for _, ro in merge_streams(streams):
        for o in ro.outputs:
            predicted.observe(o.index, o)
            if not o.token_ids and not o.text and o.finish_reason is None:
                continue
            completion_tokens += len(o.token_ids)
            tools = choice_tools[o.index]
            delta = choice_delta(tools, choice_reasoning[o.index], o)
            if not delta and o.finish_reason is None and num_logprobs is None:
                continue  # held back (a tool-call marker only partly written): nothing to send yet
            yield sse(chunk([{
                "index": o.index,
                "delta": delta,
                "logprobs": chat_logprobs(token_text, list(o.token_ids), o.logprobs, num_logprobs)
                if num_logprobs is not None else None,
                "finish_reason": tools.finish_reason(o.finish_reason),
                "stop_reason": o.stop_reason,
            }]))
    if include_usage:
        yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.response_model(req.model),
                   "choices": [], "usage": usage(prompt_tokens, completion_tokens, predicted)})
