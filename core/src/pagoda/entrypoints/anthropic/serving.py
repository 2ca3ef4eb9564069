"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over the chat completion path.

The request runs as a chat completion (``convert.chat_request``); its answer is re-written in Anthropic's
shape: the message's content blocks (``thinking`` from a ``--reasoning-parser``'s reasoning, ``text``,
``tool_use``), ``stop_reason`` and ``usage``; streamed, the chat chunks become Anthropic's events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``, and ``error`` if the engine fails mid-stream).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.entrypoints.anthropic.convert import chat_request
from pagoda.entrypoints.anthropic.errors import anthropic_error_body
from pagoda.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagoda.entrypoints.openai.serving_chat import chat_prompt_async, create_chat_completion
from pagoda.entrypoints.openai.serving_common import ServingContext

logger = logging.getLogger(__name__)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, matched: Any, tool_use: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for the chat's finish_reason and the stop string or token it matched."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_use or finish_reason == "tool_calls":
        # a forced tool (tool_choice "tool") finishes "stop" on the chat side; Anthropic reports the call
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    # arguments cut short by max_tokens do not parse: the block stays an object, as Anthropic's schema says
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(chat_usage: dict[str, Any]) -> dict[str, int]:
    return {"input_tokens": int(chat_usage.get("prompt_tokens", 0)),
            "output_tokens": int(chat_usage.get("completion_tokens", 0))}


def message_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (one choice) as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                   any(b["type"] == "tool_use" for b in content))
    return {"id": chat["id"], "type": "message", "role": "assistant", "model": chat["model"], "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(chat["usage"])}


def event(payload: dict[str, Any]) -> str:
    """One server-sent event, named by its ``type`` as Anthropic names them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


def _chat_payloads(raw: str | bytes) -> list[dict[str, Any]]:
    """The JSON chunks of one piece of the chat's SSE body (``[DONE]`` left out)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


class _Blocks:
    """The content blocks of a streamed message: opens and closes them as the deltas change kind."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.tool_blocks: dict[int, int] = {}  # the chat's tool-call index -> the block's index
        self.tool_use = False

    def start(self, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.index += 1
        self.open = block["type"]
        events.append(event({"type": "content_block_start", "index": self.index, "content_block": block}))
        return events

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": self.index})]

    def delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        events = self.start(block) if self.open != kind else []
        events.append(event({"type": "content_block_delta", "index": self.index, "delta": delta}))
        return events

    def chunk(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning_content"):
            events += self.delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                 {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            events += self.delta("text", {"type": "text", "text": ""},
                                 {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                events += self.start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                      "input": {}})
                self.tool_blocks[call["index"]] = self.index
                self.tool_use = True
            arguments = (call.get("function") or {}).get("arguments")
            if arguments and call["index"] in self.tool_blocks:
                events.append(event({"type": "content_block_delta", "index": self.tool_blocks[call["index"]],
                                     "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return events


async def _stream(chat_body: AsyncIterator[Any]) -> AsyncIterator[str]:
    blocks = _Blocks()
    started = False
    usage: dict[str, Any] = {}
    finish_reason: str | None = None
    matched: Any = None
    try:
        async for raw in chat_body:
            for chunk in _chat_payloads(raw):
                if "error" in chunk:
                    error = chunk["error"]
                    status = error.get("code") if isinstance(error.get("code"), int) else 500
                    yield event(anthropic_error_body(error.get("message", "internal error"), status))
                    return
                usage = chunk.get("usage") or usage
                if not started:
                    started = True
                    yield event({"type": "message_start", "message": {
                        "id": chunk["id"], "type": "message", "role": "assistant", "model": chunk["model"],
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": int(usage.get("prompt_tokens", 0)), "output_tokens": 0}}})
                    yield event({"type": "ping"})
                for choice in chunk["choices"]:
                    for e in blocks.chunk(choice["delta"]):
                        yield e
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if choice.get("stop_reason") is not None:
                        matched = choice["stop_reason"]
        for e in blocks.stop():
            yield e
        reason, sequence = stop_reason(finish_reason, matched, blocks.tool_use)
        yield event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": _usage(usage)})
        yield event({"type": "message_stop"})
    finally:
        # a client that goes away closes this generator: the chat body's close aborts the engine request
        aclose = getattr(chat_body, "aclose", None)
        if aclose is not None:
            await aclose()


async def create_message(ctx: ServingContext, req: MessagesRequest, raw_request: Request) -> Any:
    chat = chat_request(req, new_message_id())
    response = await create_chat_completion(ctx, chat, raw_request)
    if isinstance(response, StreamingResponse):
        return StreamingResponse(_stream(response.body_iterator), media_type="text/event-stream")
    return JSONResponse(message_body(json.loads(bytes(response.body))))


async def count_tokens(ctx: ServingContext, req: CountTokensRequest) -> dict[str, int]:
    """The prompt /v1/messages renders for the same conversation, counted (any length, as /tokenize)."""
    ctx.check_model(req.model, allow_lora=True)
    _, ids = await chat_prompt_async(ctx, chat_request(req), bounded=False)
    return {"input_tokens": len(ids)}
