"""The Responses API's pieces without a model: input items read into chat messages, output items built from
chat deltas (the events a stream sends, joined as the openai SDK joins them), and the bounded store."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol_responses import ResponsesRequest, input_messages, output_messages
from pagoda.entrypoints.openai.serving_responses import OutputItems, ResponseStore, StoredResponse


def test_input_items_become_chat_messages() -> None:
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ]})
    assert input_messages(req.input_items()) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    assert input_messages(ResponsesRequest(input="hi").input_items()) == [{"role": "user", "content": "hi"}]


def _join(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rebuild the output from the events alone, as a client does."""
    items: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] not in items
            items[e["output_index"]] = {**e["item"], "content": []} if "content" in e["item"] else dict(e["item"])
        elif e["type"] == "response.content_part.added":
            items[e["output_index"]]["content"].append(dict(e["part"]))
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            items[e["output_index"]]["status"] = e["item"]["status"]
            assert items[e["output_index"]] == e["item"]
    return [items[i] for i in sorted(items)]


def test_streamed_deltas_and_a_whole_answer_make_the_same_items() -> None:
    streamed = OutputItems()
    for delta in ({"reasoning_content": "think"}, {"reasoning_content": "ing"}, {"content": "Hel"}, {"content": "lo"},
                  {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, {}):
        streamed.feed(delta)
    streamed.finish("completed")
    events = streamed.take_events()
    assert _join(events) == streamed.items
    whole = OutputItems()
    whole.feed({"reasoning_content": "thinking", "content": "Hello",
                "tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f",
                                                                                         "arguments": "{\"a\": 1}"}}]})
    whole.finish("completed")
    strip = [{k: v for k, v in item.items() if k != "id"} for item in streamed.items]
    assert strip == [{k: v for k, v in item.items() if k != "id"} for item in whole.items]
    assert [item["type"] for item in streamed.items] == ["reasoning", "message", "function_call"]
    assert streamed.items[0]["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert streamed.items[2]["arguments"] == "{\"a\": 1}" and streamed.items[2]["call_id"] == "c1"
    assert {item["status"] for item in streamed.items} == {"completed"}
    # a follow-up continues from the answer's text and calls
    assert output_messages(streamed.items) == [{"role": "assistant", "content": "Hello", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}]


def test_an_empty_output_is_one_empty_message_marked_incomplete_when_cut() -> None:
    items = OutputItems()
    items.finish("incomplete")
    [message] = items.items
    assert message["type"] == "message" and message["status"] == "incomplete"
    assert message["content"] == [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
    kinds = [e["type"] for e in items.take_events()]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done"]


def test_the_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    store.get("a")  # now b is the least recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("a").body == {"id": "a"} and store.get("c").body == {"id": "c"}
    with pytest.raises(APIError) as missing:
        store.get("b")
    assert missing.value.status == 404
    store.delete("a")
    with pytest.raises(APIError):
        store.delete("a")
    empty = ResponseStore(0)
    empty.put("x", StoredResponse({}, []))
    assert len(empty) == 0
