"""What the completion and chat handlers share: model check, limits, sampling params, SSE, disconnects."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from pagoda.engine.async_llm import AsyncLLM, EngineDeadError, EngineGenerateError, RequestStream
from pagoda.engine.messages import PredictionCounts
from pagoda.engine.prompt_bound import PromptTooLongError, encode_bounded
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import PredictionContent, _SamplingFields
from pagoda.entrypoints.openai.structured_outputs import structured_outputs_of
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.media import MediaPolicy
from pagoda.outputs import CompletionOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from pagoda.structured_output.backend import StructuredOutputError

T = TypeVar("T")

# SamplingParams' own errors start with the field name; these are the names a client can send.
_PARAM_NAMES = (
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "bad_words", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "truncate_prompt_tokens", "allowed_token_ids", "logit_bias",
)


@dataclass
class ServingContext:
    engine: AsyncLLM
    served_model_names: list[str]
    max_model_len: int
    max_logprobs: int
    max_n: int
    chat_template: str | None = None
    # a request's own chat_template is arbitrary Jinja: refused unless the operator trusts clients (vLLM's flag)
    trust_request_chat_template: bool = False
    # seconds any chat template may render (0 = unbounded)
    chat_template_render_timeout: float = 5.0
    created: int = field(default_factory=lambda: int(time.time()))
    # SamplingParams field -> value for fields a request leaves unset (the model's generation config)
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # what the model is for (vLLM's supported tasks): "generate", or pooling tasks ("embed", "classify", "score", ...)
    supported_tasks: tuple[str, ...] = ("generate",)
    # the IO processor plugin (pagoda.plugins.io_processors) that /pooling requests with "data" go to
    io_processor: Any = None
    # tool_choice "auto": vLLM's --enable-auto-tool-choice, and the --tool-call-parser class (a ToolParser)
    enable_auto_tool_choice: bool = False
    tool_parser: Any = None
    # the base model's names and the LoRA adapters (pagoda.entrypoints.openai.serving_models.ServingModels)
    models: Any = None
    # /tokenize's unbounded work runs on its own thread with its own tokenizer copy, so a 10 MB text
    # there never queues ahead of a generation request's prompt on the engine's preparation thread
    tokenize_executor: Any = None
    _tokenize_copy: Any = None
    # where chat image_url parts may be read from (--allowed-local-media-path, --allowed-media-domains)
    media: MediaPolicy = field(default_factory=MediaPolicy)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def check_model(self, model: str | None, allow_lora: bool = False) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a model nobody serves, 400 for an
        adapter on an endpoint that serves the base model only (``allow_lora`` False)."""
        if self.models is not None:
            return self.models.resolve(model, allow_lora)
        if model is not None and model not in self.served_model_names:
            raise APIError(f"The model `{model}` does not exist; this server serves {self.served_model_names}.", 404, "model",
                           code="model_not_found")
        return None

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response reports: the adapter the request named, else the served name (vLLM's rule)."""
        if model is not None and self.models is not None and model in self.models.lora_requests:
            return model
        return self.model_name

    async def resolve_model(self, model: str | None) -> LoRARequest | None:
        """``check_model`` for an endpoint that serves adapters, the LoRA resolvers asked for an unknown name."""
        if self.models is not None:
            return await self.models.resolve_async(model)
        return self.check_model(model)

    def need_tokenizer(self) -> Any:
        tok = self.tokenizer
        if tok is None:
            raise APIError("the server runs without a tokenizer (skip_tokenizer_init): send prompts as token ids", 400, "prompt")
        return tok

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """A generation prompt's ids, off the event loop; a text far over the context is refused (400,
        naming ``param``) after tokenizing only a prefix."""
        tok = self.need_tokenizer()
        try:
            return await self.engine.run_prep(encode_bounded, tok, text, self.max_model_len, add_special_tokens)
        except PromptTooLongError as exc:
            raise APIError(str(exc), 400, param) from None

    async def encode_unbounded(self, text: str, add_special_tokens: bool) -> list[int]:
        """/tokenize's ids (any length, as vLLM counts them) on ``tokenize_executor``."""
        tok = self.need_tokenizer()
        if self.tokenize_executor is None:
            return list(await self.engine.run_prep(lambda: tok(text, add_special_tokens=add_special_tokens).input_ids))

        def encode() -> list[int]:
            # the copy is made on first use, on the executor's thread: deep-copying a tokenizer takes a while
            if self._tokenize_copy is None:
                import copy

                self._tokenize_copy = copy.deepcopy(tok)
            return list(self._tokenize_copy(text, add_special_tokens=add_special_tokens).input_ids)

        return await asyncio.get_running_loop().run_in_executor(self.tokenize_executor, encode)


async def request_context(raw_request: Request, data: Any = None) -> ServingContext:
    """The context of the model a request is for; every route gets its context here. A one-model server's
    own; on a many-model server (pagoda.entrypoints.openai.model_pool) the one the body's ``model`` names
    (``data``: the parsed JSON body), loaded first when it is not, and held until the response ends."""
    pool = getattr(raw_request.app.state, "pool", None)
    if pool is None:
        ctx: ServingContext = raw_request.app.state.ctx
        return ctx
    return await pool.acquire(raw_request, data)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_limits(ctx: ServingContext, req: _SamplingFields, logprobs: int | None) -> None:
    if req.n > ctx.max_n:
        raise APIError(f"n={req.n} is larger than this server's limit of {ctx.max_n}", 400, "n")
    if req.best_of is not None and req.best_of > ctx.max_n:
        raise APIError(f"best_of={req.best_of} is larger than this server's limit of {ctx.max_n}", 400, "best_of")
    if logprobs is not None and logprobs > ctx.max_logprobs:
        raise APIError(f"logprobs={logprobs} is larger than max_logprobs={ctx.max_logprobs}", 400, "logprobs")
    if req.prompt_logprobs is not None and req.prompt_logprobs > ctx.max_logprobs:
        raise APIError(f"prompt_logprobs={req.prompt_logprobs} is larger than max_logprobs={ctx.max_logprobs}", 400,
                       "prompt_logprobs")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise APIError("best_of > n cannot be streamed: the best sequences are only known at the end", 400, "best_of")


def check_prompt_length(ctx: ServingContext, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
    """-> the max_tokens to use (None = the rest of the context); 400 naming both numbers when it cannot fit."""
    if num_prompt_tokens >= ctx.max_model_len:
        raise APIError(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens; it must be shorter to leave room for at least one generated token.",
            400, param,
        )
    room = ctx.max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Reduce the prompt or max_tokens.",
            400, "max_tokens",
        )
    return max_tokens


def default_max_tokens(ctx: ServingContext, num_prompt_tokens: int) -> int | None:
    """The model's default output length (generation_config's max_new_tokens), capped by the context left."""
    default = ctx.default_sampling.get("max_tokens")
    return None if default is None else min(int(default), max(1, ctx.max_model_len - num_prompt_tokens))


def build_sampling_params(
    req: _SamplingFields, max_tokens: int, logprobs: int | None, stream: bool,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """``defaults`` (the model's generation config) fill the fields the request left unset; then pagoda's own."""
    fallback = {"repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, **(defaults or {})}

    def pick(name: str) -> Any:
        value = getattr(req, name)
        return value if value is not None else fallback[name]

    kwargs: dict[str, Any] = dict(
        n=req.n,
        best_of=req.best_of,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=pick("repetition_penalty"),
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=pick("top_k"),
        min_p=pick("min_p"),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        bad_words=req.bad_words,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        allowed_token_ids=req.allowed_token_ids,
        logit_bias=req.logit_bias,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs_of(req),
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), 400, _param_of(str(exc))) from None


def _param_of(message: str) -> str | None:
    head = message.split(" ", 1)[0].rstrip(":,.")
    return head if head in _PARAM_NAMES else None


def engine_error(exc: Exception, param: str | None = "prompt") -> APIError:
    """A ValueError from the engine's input checks is the client's fault (the field it names, else ``param``)."""
    if isinstance(exc, StructuredOutputError):
        param = "structured_outputs"
    return APIError(str(exc), 400, _param_of(str(exc)) or param)


async def start_streams(ctx: ServingContext, prompts: list[dict[str, Any]], params: SamplingParams, request_id: str,
                        priority: int, lora_request: LoRARequest | None = None) -> list[RequestStream]:
    """Queue one engine request per prompt; all or none (a bad prompt aborts the ones already queued)."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await ctx.engine.add_request_async(rid, prompt, params, priority, lora_request))
    except ValueError as exc:
        for s in streams:
            s.abort()
        raise engine_error(exc) from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams as (prompt index, output); cancelling aborts them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item[1], BaseException):
                raise item[1]
            yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise APIError("the client disconnected", 499)


async def collect_finals(raw_request: Request, streams: list[RequestStream]) -> dict[int, Any]:
    """Each prompt's final output (non-streaming answers); streams are aborted however this ends."""
    finals: dict[int, Any] = {}

    async def collect() -> None:
        async for i, out in merge_streams(streams):
            finals[i] = out

    try:
        await until_disconnected(raw_request, collect())
    except EngineGenerateError as exc:
        raise APIError(f"internal engine error: {exc}", 500) from None
    except EngineDeadError as exc:
        # the engine core (thread or process) is gone: /health says 503 too
        raise APIError(f"the engine is dead: {exc}", 503) from None
    finally:
        for stream in streams:
            stream.abort()
    for final in finals.values():
        for out in getattr(final, "outputs", None) or []:
            # only a constraint that failed to compile (scheduler's _fail_constraint) ends with an error, no
            # token and a message: the client's constraint was over a budget or invalid, so a 400 naming it
            if out.finish_reason == "error" and not out.token_ids and isinstance(out.stop_reason, str):
                raise APIError(out.stop_reason, 400, "structured_outputs")
    return finals


async def sse_response_body(streams: list[RequestStream], events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """``events`` then ``[DONE]``; an engine failure becomes an error event, and the streams
    are aborted however the response ends (a client that goes away closes this generator)."""
    try:
        async for event in events:
            yield event
    except EngineGenerateError as exc:
        yield sse({"error": {"message": f"internal engine error: {exc}", "type": "InternalServerError", "param": None,
                             "code": 500}})
    except EngineDeadError as exc:
        yield sse({"error": {"message": f"the engine is dead: {exc}", "type": "ServiceUnavailableError",
                             "param": None, "code": 503}})
    finally:
        await events.aclose()
        for stream in streams:
            stream.abort()
    yield SSE_DONE


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def safe_logprob(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a very negative number
    return value if math.isfinite(value) else -9999.0


class PredictionUsage:
    """Predicted outputs: each choice's latest counts, summed into ``usage.completion_tokens_details``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._by_choice: dict[int, PredictionCounts] = {}

    def observe(self, choice: int, output: CompletionOutput) -> None:
        if output.prediction is not None:
            self._by_choice[choice] = output.prediction

    def details(self) -> dict[str, int]:
        counts = self._by_choice.values()
        return {"accepted_prediction_tokens": sum(c.accepted_prediction_tokens for c in counts),
                "rejected_prediction_tokens": sum(c.rejected_prediction_tokens for c in counts)}


async def prediction_prompt(ctx: ServingContext, prompt: dict[str, Any], prediction: PredictionContent | None) -> None:
    """Put a request's prediction, tokenized as output text is (no special tokens), into its engine prompt."""
    if prediction is not None:
        prompt["prediction_token_ids"] = await ctx.encode_unbounded(prediction.text, False)


def usage(prompt_tokens: int, completion_tokens: int, prediction: PredictionUsage | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if prediction is not None and prediction.enabled:
        body["completion_tokens_details"] = prediction.details()
    return body
