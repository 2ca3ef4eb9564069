"""The server's side of tool calls without a model: reading calls out of unfinished JSON, and the deltas of
tool_choice required / named streamed token by token, joined up as a client does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.tool_calls import ChatToolCalls
from pagoda.entrypoints.openai.tool_parsers import ScanMemo, ToolCallDeltaStream, partial_marker_len, scan_call_list

REQUEST = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                tools=[{"type": "function", "function": {"name": "f"}},
                                       {"type": "function", "function": {"name": "g"}}], tool_choice="required")
CALLS = [{"name": "f", "parameters": {"s": "a \"q\" ] } \\ ü", "n": [1, -2.5e3, None, True], "o": {"k": {}}}},
         {"parameters": {"x": 1}, "name": "g"}]
OUTPUT = json.dumps(CALLS, indent=1, ensure_ascii=False)


def test_scan_reads_each_prefix_as_a_prefix_of_the_final_reading() -> None:
    final, end, error = scan_call_list(OUTPUT, 0, ("name",), ("parameters",))
    assert not error and end == len(OUTPUT)
    assert [(c.name, json.loads(c.arguments)) for c in final] == [(c["name"], c["parameters"]) for c in CALLS]
    for cut in range(len(OUTPUT)):
        calls, _, error = scan_call_list(OUTPUT[:cut], 0, ("name",), ("parameters",))
        assert not error
        for partial, whole in zip(calls, final):
            assert whole.arguments.startswith(partial.arguments)
            assert partial.name in (None, whole.name)


def test_a_memo_resumes_scans_and_reads_the_same_as_a_fresh_scan() -> None:
    memo = ScanMemo()
    for cut in range(len(OUTPUT) + 1):
        with_memo = scan_call_list(OUTPUT[:cut], 0, ("name",), ("parameters",), memo)
        assert with_memo == scan_call_list(OUTPUT[:cut], 0, ("name",), ("parameters",))
    # a text that does not extend the last one starts over
    other = OUTPUT.replace('"s"', '"t"')
    assert scan_call_list(other, 0, ("name",), ("parameters",), memo) == \
        scan_call_list(other, 0, ("name",), ("parameters",))


def test_scan_refuses_what_is_not_a_list_of_call_objects() -> None:
    assert scan_call_list('[1, 2]', 0)[2]
    assert scan_call_list('[{"name" "f"}]', 0)[2]
    assert scan_call_list('{"name": "f"}', 0)[2]


def test_partial_marker_len() -> None:
    assert partial_marker_len("Hi <tool_c", "<tool_call>") == 7
    assert partial_marker_len("Hi <", "<tool_call>") == 1
    assert partial_marker_len("Hi <tool_call>", "<tool_call>") == 0
    assert partial_marker_len("Hi", "<tool_call>") == 0


def test_delta_stream_sends_only_what_is_new() -> None:
    stream = ToolCallDeltaStream(lambda: "id-1")
    first = stream.update("He", [(None, "")])
    assert first is not None and first.content == "He" and first.tool_calls == []
    second = stream.update("He", [("f", '{"a"')])
    assert second is not None and second.content is None
    assert second.tool_calls[0].model_dump(exclude_none=True) == {
        "index": 0, "id": "id-1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    assert stream.update("He", [("f", '{"a"')]) is None
    third = stream.update("He", [("f", '{"a": 1}')])
    assert third is not None
    assert third.tool_calls[0].model_dump(exclude_none=True) == {"index": 0, "function": {"arguments": ": 1}"}}


def _streamed(kind: str, text: str, chunk: int, function_name: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    choice = ChatToolCalls(kind, REQUEST, function_name=function_name).choice()
    deltas = [choice.start() or {}]
    for i in range(0, len(text), chunk):
        piece = text[i:i + chunk]
        deltas.append(choice.delta(piece, [0] * len(piece), i + chunk >= len(text)))
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        assert "content" not in delta
        for piece in delta.get("tool_calls", []):
            if piece["index"] == len(calls):
                assert piece["id"].startswith("chatcmpl-tool-") and piece["type"] == "function"
                calls.append({"name": piece["function"]["name"], "arguments": ""})
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["arguments"] += piece["function"].get("arguments", "")
    return calls, choice.finish_reason("stop")


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_required_streams_calls_that_join_up_to_the_output(chunk: int) -> None:
    calls, finish = _streamed("required", OUTPUT, chunk)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(c["name"], c["parameters"]) for c in CALLS]
    assert finish == "tool_calls"
    # the non-streamed answer holds the same calls
    message, finish = ChatToolCalls("required", REQUEST).choice().message(OUTPUT, "stop")
    assert finish == "tool_calls" and message["content"] == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [(c["name"], c["parameters"]) for c in CALLS]


@pytest.mark.parametrize("chunk", [1, 3])
def test_named_streams_the_output_as_arguments(chunk: int) -> None:
    text = json.dumps(CALLS[0]["parameters"])
    calls, finish = _streamed("named", text, chunk, function_name="f")
    assert calls == [{"name": "f", "arguments": text}]
    assert finish == "stop"  # as vLLM and OpenAI: a forced function keeps the engine's reason


def test_required_cut_off_answers_what_the_stream_delivered() -> None:
    # issue 39: the same output gives the same answer streamed or not, a cut-off one too (the partial call)
    streamed, _ = _streamed("required", OUTPUT[:40], 5)
    message, finish = ChatToolCalls("required", REQUEST).choice().message(OUTPUT[:40], "length")
    assert finish == "length" and message["content"] == ""
    assert [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]] \
        == streamed == [{"name": "f", "arguments": "{\n  "}]
