"""The Anthropic <-> chat conversions on their own (no server): the request as a chat completion, a chat answer
as a message, and chat chunks as Anthropic's events, including the parts the 135M server tests cannot reach
(reasoning from a --reasoning-parser, text then a parsed tool call in one answer, an engine error mid-stream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pagoda.entrypoints.anthropic.convert import chat_request
from pagoda.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagoda.entrypoints.anthropic.serving import _stream, message_body


def _request(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})


def test_conversation_becomes_chat_messages_in_order() -> None:
    req = _request(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "and?"}]}],
        tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "any",
                                                                              "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=3)
    chat = chat_request(req, "msg_x")
    assert [(m.role, m.tool_call_id) for m in chat.messages] == [
        ("system", None), ("user", None), ("assistant", None), ("tool", "t1"), ("tool", "t2"), ("user", None)]
    assert chat.messages[0].content == "a\nb"
    assistant = chat.messages[2]
    assert [p.text for p in assistant.content] == ["calling"]  # the thinking block is dropped
    assert assistant.tool_calls[0].function.name == "f" and json.loads(assistant.tool_calls[0].function.arguments) == \
        {"x": 1}
    assert chat.messages[4].content == "Error: boom"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens, chat.request_id) == \
        (["END"], 0.5, 3, 8, "msg_x")
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_tool_choice_mapping() -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    msgs = [{"role": "user", "content": "x"}]
    for anthropic_choice, chat_choice in (({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                          ({"type": "tool", "name": "f"},
                                           {"type": "function", "function": {"name": "f"}})):
        assert chat_request(_request(messages=msgs, tools=tools, tool_choice=anthropic_choice)).tool_choice == \
            chat_choice
    counted = chat_request(CountTokensRequest.model_validate({"model": "m", "messages": msgs,
                                                              "thinking": {"type": "disabled"}}))
    assert counted.chat_template_kwargs == {"enable_thinking": False} and counted.max_tokens is None


def test_output_config_is_response_format_and_effort() -> None:
    schema = {"type": "object"}
    msgs = [{"role": "user", "content": "x"}]
    chat = chat_request(_request(messages=msgs, output_config={"effort": "low", "format": {
        "type": "json_schema", "schema": schema}}))
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert chat.reasoning_effort == "low"
    assert chat_request(_request(messages=msgs, output_format={"type": "json_schema", "schema": schema})) \
        .response_format["json_schema"]["schema"] == schema
    with pytest.raises(ValueError, match="both"):
        _request(messages=msgs, output_format={"type": "json_schema", "schema": schema},
                 output_config={"format": {"type": "json_schema", "schema": schema}})


def _chat(message: dict[str, Any], finish: str, matched: Any = None) -> dict[str, Any]:
    return {"id": "msg_1", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 7},
            "choices": [{"message": message, "finish_reason": finish, "stop_reason": matched}]}


@pytest.mark.parametrize(("message", "finish", "matched", "reason", "sequence"), [
    ({"content": "hi"}, "stop", None, "end_turn", None),
    ({"content": "hi"}, "stop", 2, "end_turn", None),  # a stop token id is not a stop sequence
    ({"content": "hi"}, "stop", "END", "stop_sequence", "END"),
    ({"content": "hi"}, "length", None, "max_tokens", None),
    ({"content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}, "stop", None,
     "tool_use", None),
    ({"content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{\"a\": "}}]}, "length",
     None, "max_tokens", None),
])
def test_stop_reasons(message: dict[str, Any], finish: str, matched: Any, reason: str, sequence: str | None) -> None:
    body = message_body(_chat(message, finish, matched))
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)
    assert body["usage"] == {"input_tokens": 5, "output_tokens": 7}


def test_message_blocks_reasoning_text_and_tool() -> None:
    body = message_body(_chat({"content": "let me check", "reasoning_content": "think",
                               "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                                              {"id": "c2", "function": {"name": "g", "arguments": "{\"a\": "}}]},
                              "tool_calls"))
    assert body["content"] == [{"type": "thinking", "thinking": "think", "signature": ""},
                               {"type": "text", "text": "let me check"},
                               {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
                               {"type": "tool_use", "id": "c2", "name": "g", "input": {}}]
    assert body["stop_reason"] == "tool_use" and body["id"] == "msg_1" and body["type"] == "message"


async def _chunks(payloads: list[dict[str, Any]]) -> AsyncIterator[str]:
    for p in payloads:
        yield f"data: {json.dumps(p)}\n\n"
    yield "data: [DONE]\n\n"


def _events(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async def run() -> list[str]:
        return [e async for e in _stream(_chunks(payloads))]

    out = []
    for raw in asyncio.run(run()):
        name, data = raw.strip().split("\n")
        payload = json.loads(data[len("data: "):])
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def _chunk(delta: dict[str, Any], finish: str | None = None, completion: int = 0) -> dict[str, Any]:
    return {"id": "msg_1", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": completion},
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": None}]}


def test_stream_thinking_text_then_tool_blocks() -> None:
    events = _events([
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "th"}, completion=1),
        _chunk({"content": "ok"}, completion=2),
        _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f",
                                                                                           "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}, completion=3),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls", completion=4),
        {"id": "msg_1", "model": "m", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
    ])
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None), ("ping", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2),
        ("content_block_stop", 2), ("message_delta", None), ("message_stop", None)]
    assert events[0]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert events[3]["delta"] == {"type": "thinking_delta", "thinking": "th"}
    assert events[8]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[9:11]) == "{\"a\": 1}"
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 5, "output_tokens": 4}


def test_stream_engine_error_is_an_error_event() -> None:
    events = _events([_chunk({"role": "assistant", "content": ""}), _chunk({"content": "a"}),
                      {"error": {"message": "the engine is dead: x", "type": "ServiceUnavailableError",
                                 "param": None, "code": 503}}])
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                     "message": "the engine is dead: x"}}
    assert "message_stop" not in [e["type"] for e in events]
