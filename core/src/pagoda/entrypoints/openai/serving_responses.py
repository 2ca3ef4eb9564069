"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

The input becomes chat messages (``protocol_responses``) and is generated as a chat completion is
(``prepare_chat_generation``: template, tool parser, reasoning parser, structured outputs); what comes out
becomes output items: a ``reasoning`` item, a ``message`` with one ``output_text`` part, ``function_call``
items. Streamed, the same items are built delta by delta and each step is sent as OpenAI's typed events.
Finished responses are kept (``store``, the default) in a bounded in-memory store, for GET and for
``previous_response_id``.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from pagoda.engine.async_llm import EngineDeadError, EngineGenerateError, RequestStream
from pagoda.entrypoints.openai.errors import APIError, validation_error
from pagoda.entrypoints.openai.protocol_responses import ResponsesRequest, input_messages, output_messages
from pagoda.entrypoints.openai.reasoning import chat_reasoning
from pagoda.entrypoints.openai.serving_chat import ChatGeneration, choice_delta, choice_message, prepare_chat_generation
from pagoda.entrypoints.openai.pooling_routes import validate_body
from pagoda.entrypoints.openai.serving_common import (
    ServingContext,
    collect_finals,
    merge_streams,
    request_context,
    start_streams,
)
from pagoda.entrypoints.openai.serving_pooling import require_generate

logger = logging.getLogger(__name__)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    body: dict[str, Any]
    # the conversation a follow-up continues: input and output as chat messages, without the instructions
    # (OpenAI's rule: a response's instructions do not carry over to the next through previous_response_id)
    messages: list[dict[str, Any]]


class ResponseStore:
    """Finished responses by id, the least recently used dropped past ``max_entries`` (0: nothing is kept)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries <= 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found (never stored, deleted, or dropped from "
                           f"this server's store of the last {self.max_entries} responses).", 404, "response_id")
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def __len__(self) -> int:
        return len(self._entries)


class OutputItems:
    """One response's output items, built from chat deltas; each step queues the typed events it makes (without
    ``sequence_number``, which the stream adds)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> dict[str, Any]:
        self.close()
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))
        if part is not None:
            item["content"].append(part)
            self._emit("response.content_part.added", **self._where(item), content_index=0, part=dict(part))
        return item

    def reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._start({"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)

    def text(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = self._start({"id": _item_id("msg"), "type": "message", "role": "assistant", "content": [],
                                "status": "in_progress"},
                               {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        item["content"][0]["text"] += text
        self._emit("response.output_text.delta", **self._where(item), content_index=0, delta=text, logprobs=[])

    def call(self, index: int, call_id: str, name: str) -> None:
        self._calls[index] = self._start({"id": _item_id("fc"), "type": "function_call", "call_id": call_id,
                                          "name": name, "arguments": "", "status": "in_progress"})

    def arguments(self, index: int, text: str) -> None:
        item = self._calls[index]
        item["arguments"] += text
        self._emit("response.function_call_arguments.delta", **self._where(item), delta=text)

    def feed(self, delta: dict[str, Any]) -> None:
        """A chat delta (content, reasoning_content, tool_calls) into the items."""
        if delta.get("reasoning_content"):
            self.reasoning(delta["reasoning_content"])
        if delta.get("content"):
            self.text(delta["content"])
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function") or {}
            if piece.get("id") is not None:
                self.call(piece["index"], piece["id"], function.get("name") or "")
            if function.get("arguments"):
                self.arguments(piece["index"], function["arguments"])

    def close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                self._emit("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            else:
                self._emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        item["status"] = status
        self._emit("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item))

    def finish(self, status: str) -> None:
        """Close the last item; an output with no item at all still answers with an (empty) message."""
        if not self.items:
            self._start({"id": _item_id("msg"), "type": "message", "role": "assistant", "content": [],
                         "status": "in_progress"}, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.close("incomplete" if status == "incomplete" else "completed")

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


class ResponseRun:
    """One request's response object and what its answer is generated from."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, generation: ChatGeneration, history: list[dict[str, Any]],
                 new_messages: list[dict[str, Any]]) -> None:
        self.ctx = ctx
        self.req = req
        self.generation = generation
        self.history = history
        self.new_messages = new_messages
        self.id = req.request_id or _item_id("resp")
        self.created_at = int(time.time())
        self.items = OutputItems()
        self.tools = generation.tool_calls.choice()
        self.splitter = chat_reasoning(ctx, generation.request, generation.prompt_ids)

    def body(self, status: str, usage: dict[str, Any] | None = None, incomplete: bool = False,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        req, params = self.req, self.generation.params
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "metadata": req.metadata or {}, "model": self.ctx.response_model(req.model),
            "output": copy.deepcopy(self.items.items) if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": req.text.format.echo()}, "tool_choice": req.tool_choice,
            "tools": [t.model_dump(exclude_none=True) | {"strict": t.strict} for t in req.tools],
            "truncation": "disabled", "usage": usage, "user": req.user,
        }

    def usage(self, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        reasoning = "".join(p["text"] for item in self.items.items if item["type"] == "reasoning"
                            for p in item["content"])
        # the reasoning's share of the output, counted by tokenizing the reasoning text again
        reasoning_tokens = len(self.ctx.need_tokenizer()(reasoning, add_special_tokens=False).input_ids) \
            if reasoning else 0
        return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt_tokens + output_tokens}

    def stored(self, body: dict[str, Any]) -> StoredResponse:
        return StoredResponse(body, self.history + self.new_messages + output_messages(body["output"]))


async def _prepare(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest) -> ResponseRun:
    history = store.get(req.previous_response_id).messages if req.previous_response_id else []
    new_messages = input_messages(req.input_items())
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    try:
        chat = req.to_chat_request(system + history + new_messages)
    except ValidationError as exc:
        error = validation_error(exc)
        # a chat-side check (the conversation's shape): the messages came from ``input``
        raise APIError(error.message, 400, "input" if (error.param or "").startswith("messages") else error.param) \
            from None
    generation = await prepare_chat_generation(ctx, chat, None, prompt_param="input",
                                               max_tokens_param="max_output_tokens")
    return ResponseRun(ctx, req, generation, history, new_messages)


async def create_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest,
                          raw_request: Request) -> Any:
    lora_request = await ctx.resolve_model(req.model)
    run = await _prepare(ctx, store, req)
    streams = await start_streams(ctx, [run.generation.prompt], run.generation.params, run.id,
                                  run.generation.request.priority, lora_request)
    if req.stream:
        return StreamingResponse(_sse(streams, _events(run, store, streams)), media_type="text/event-stream")
    ro = (await collect_finals(raw_request, streams))[0]
    o = ro.outputs[0]
    reasoning, message, finish_reason = choice_message(run.tools, run.splitter, o.text, o.finish_reason)
    run.items.feed({"reasoning_content": reasoning, "content": message.get("content"),
                    "tool_calls": [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or [])]})
    incomplete = finish_reason == "length"
    run.items.finish("incomplete" if incomplete else "completed")
    body = run.body("incomplete" if incomplete else "completed",
                    run.usage(len(run.generation.prompt_ids), len(o.token_ids), ro.num_cached_tokens), incomplete)
    if req.store:
        store.put(run.id, run.stored(body))
    return JSONResponse(body)


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def _events(run: ResponseRun, store: ResponseStore, streams: list[RequestStream]) -> AsyncGenerator[str, None]:
    sequence = 0

    def send(event: dict[str, Any]) -> str:
        nonlocal sequence
        event = {**event, "sequence_number": sequence}
        sequence += 1
        return _event(event["type"], event)

    yield send({"type": "response.created", "response": run.body("in_progress")})
    yield send({"type": "response.in_progress", "response": run.body("in_progress")})
    opening = run.tools.start()  # a named function's call opens before its arguments
    if opening:
        run.items.feed(opening)
    output_tokens, cached, finish_reason = 0, 0, None
    try:
        async for _, ro in merge_streams(streams):
            cached = ro.num_cached_tokens
            for o in ro.outputs:
                output_tokens += len(o.token_ids)
                if not o.token_ids and not o.text and o.finish_reason is None:
                    continue
                run.items.feed(choice_delta(run.tools, run.splitter, o))
                finish_reason = run.tools.finish_reason(o.finish_reason) or finish_reason
            for event in run.items.take_events():
                yield send(event)
    except (EngineGenerateError, EngineDeadError) as exc:
        failed = run.body("failed", error={"code": "server_error", "message": f"the engine failed: {exc}"})
        yield send({"type": "response.failed", "response": failed})
        return
    incomplete = finish_reason == "length"
    run.items.finish("incomplete" if incomplete else "completed")
    for event in run.items.take_events():
        yield send(event)
    status = "incomplete" if incomplete else "completed"
    body = run.body(status, run.usage(len(run.generation.prompt_ids), output_tokens, cached), incomplete)
    if run.req.store:
        store.put(run.id, run.stored(body))
    yield send({"type": f"response.{status}", "response": body})


async def _sse(streams: list[RequestStream], events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """``events``, the engine requests aborted however the response ends (a client that goes away closes it);
    unlike chat's stream there is no ``[DONE]``: the terminal event ends it, as OpenAI's does."""
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()
        for stream in streams:
            stream.abort()


def add_responses_routes(app: FastAPI, store_max_entries: int,
                         read_json: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
    """Register the Responses API on ``app`` (its store lives as long as the app); ``read_json`` reads a body as
    the other routes do."""
    store = ResponseStore(store_max_entries)
    app.state.responses_store = store

    async def create(raw_request: Request) -> Any:
        data = await read_json(raw_request)
        ctx = await request_context(raw_request, data)  # on a many-model server: the model the body names
        require_generate(ctx, "/v1/responses")
        return await create_response(ctx, store, validate_body(data, ResponsesRequest), raw_request)

    async def retrieve(response_id: str, stream: bool = False) -> Any:
        if stream:
            raise APIError("replaying a stored response as a stream is not supported: GET it without stream", 400,
                           "stream")
        return JSONResponse(store.get(response_id).body)

    async def delete(response_id: str) -> Any:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    app.add_api_route("/v1/responses", create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
