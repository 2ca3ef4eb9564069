"""An Anthropic Messages request as the chat completion the server already runs (vLLM's approach): the same
chat template, tool handling, structured outputs and sampling, so both APIs answer a conversation alike.

- ``system`` -> a system message; text blocks -> text parts; ``tool_use`` blocks -> the assistant's
  ``tool_calls`` (``input`` as JSON ``arguments``); ``tool_result`` blocks -> ``tool`` messages, in order.
- thinking blocks of earlier turns are dropped, as Anthropic drops them from the context.
- ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` / the named function /
  ``none``; ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
- ``output_config.format`` (or ``output_format``) -> ``response_format`` ``json_schema``;
  ``output_config.effort`` -> ``reasoning_effort``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagoda.entrypoints.anthropic.protocol import (
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    _Conversation,
)
from pagoda.entrypoints.openai.errors import validation_error
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest

# How a tool_result with is_error reaches the model: the chat format has no such flag (beyond Anthropic's API,
# whose own rendering is not public).
TOOL_ERROR_PREFIX = "Error: "


def _text_parts(blocks: list[TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _user_messages(blocks: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[TextBlock] = []

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": _text_parts(pending)})
            pending.clear()

    for block in blocks:
        if isinstance(block, TextBlock):
            pending.append(block)
        elif isinstance(block, ToolResultBlock):
            flush()
            text = TOOL_ERROR_PREFIX + block.text if block.is_error else block.text
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
    flush()
    return out


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    texts = [b for b in blocks if isinstance(b, TextBlock)]
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts else ("" if not calls
                                                                                                  else None)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(req: _Conversation) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = req.system_text
    if system is not None:
        out.append({"role": "system", "content": system})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant_message(m.content))
        else:
            out.extend(_user_messages(m.content))
    return out


def _tool_fields(req: _Conversation) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return fields  # the chat default: "auto" with tools, as Anthropic's
    fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
        {"type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def chat_request(req: _Conversation, request_id: str | None = None) -> ChatCompletionRequest:
    """The chat completion ``req`` asks for (a CountTokensRequest: the prompt part only)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), **_tool_fields(req)}
    if req.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": req.json_schema}}
    if req.output_config is not None and req.output_config.effort is not None:
        body["reasoning_effort"] = req.output_config.effort
    if req.thinking is not None:
        # {"type": "disabled"} (the only one accepted): templates that think by default are told not to
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream, request_id=request_id)
        for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                            ("stop", req.stop_sequences)):
            if value is not None:
                body[name] = value
        if req.stream:
            # every chunk carries the usage: message_start reports input_tokens before any output
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
