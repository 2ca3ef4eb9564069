"""The four parsers on outputs written in their models' formats: whole outputs, and the same outputs streamed
character by character and in uneven chunks, whose deltas must join up to the same calls and content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagoda.plugins import get_plugin_manager

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
REQUEST = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="auto")

PARIS = {"city": "Paris", "unit": "celsius", "note": "a \"quoted\" }] string, ünïcode"}
CET = {"zone": "CET", "nested": {"list": [1, 2.5, None, True, {"deep": []}]}}

# (parser, output, expected content, expected [(name, arguments)])
CASES: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}\n</tool_call>', None,
     [("get_weather", PARIS)]),
    ("hermes", f'Let me check.\n<tool_call>{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}</tool_call>\n'
               f'<tool_call>{{"arguments": {json.dumps(CET)}, "name": "get_time"}}</tool_call>', "Let me check.\n",
     [("get_weather", PARIS), ("get_time", CET)]),
    # cut off by max_tokens inside the end tag: the call itself is whole
    ("hermes", f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}\n</tool_c', None,
     [("get_weather", PARIS)]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(PARIS)}}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {json.dumps(PARIS)}}}; '
                    f'{{"name": "get_time", "arguments": {json.dumps(CET)}}}', None,
     [("get_weather", PARIS), ("get_time", CET)]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}, '
                f'{{"name": "get_time", "arguments": {json.dumps(CET)}}}]', None,
     [("get_weather", PARIS), ("get_time", CET)]),
    ("mistral", f"Sure.[TOOL_CALLS]get_weather[ARGS]{json.dumps(PARIS)}[TOOL_CALLS]get_time[ARGS]{json.dumps(CET)}",
     "Sure.", [("get_weather", PARIS), ("get_time", CET)]),
    ("mistral", "Just text [TOOL_ CALLS] here", "Just text [TOOL_ CALLS] here", []),
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\', note="a \\"quoted\\" }] string, ünïcode"), '
                 'get_time(zone="CET", nested={"list": [1, 2.5, None, True, {"deep": []}]})]', None,
     [("get_weather", PARIS), ("get_time", CET)]),
    ("pythonic", "It is sunny in Paris.", "It is sunny in Paris.", []),
    # never executed: a call whose argument is code stays text
    ("pythonic", '[get_weather(city=__import__("os").getcwd())]', '[get_weather(city=__import__("os").getcwd())]', []),
]


def _parser(name: str) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)(None)


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_extract_tool_calls(name: str, output: str, content: str | None,
                            calls: list[tuple[str, dict[str, Any]]]) -> None:
    info = _parser(name).extract_tool_calls(output, REQUEST)
    assert info.tools_called == bool(calls)
    assert info.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls
    assert len({c.id for c in info.tool_calls}) == len(calls)


def _stream(name: str, chunks: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feed ``chunks`` as a server does; -> (content, calls) rebuilt from the deltas as an OpenAI client does."""
    parser = _parser(name)
    content = ""
    calls: list[dict[str, Any]] = []
    text = ""
    deltas = []
    for chunk in chunks:
        previous, text = text, text + chunk
        deltas.append(parser.extract_tool_calls_streaming(previous, text, chunk, [], [], [], REQUEST))
    deltas.append(parser.finish_streaming(text, REQUEST))
    for delta in deltas:
        if delta is None:
            continue
        content += delta.content or ""
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                # a call's first piece: id, type and name, before any other piece of it
                assert piece.id and piece.type == "function" and piece.function and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.id is None and piece.function is not None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return content, calls


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
@pytest.mark.parametrize("chunking", ["chars", "uneven"])
def test_streamed_deltas_join_up_to_the_same_calls(name: str, output: str, content: str | None,
                                                   calls: list[tuple[str, dict[str, Any]]], chunking: str) -> None:
    if chunking == "chars":
        chunks = list(output)
    else:
        sizes = [3, 1, 7, 2, 11, 5]
        chunks, i, k = [], 0, 0
        while i < len(output):
            chunks.append(output[i:i + sizes[k % len(sizes)]])
            i += sizes[k % len(sizes)]
            k += 1
    streamed_content, streamed_calls = _stream(name, chunks)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls


def test_marker_prefix_is_held_back_until_known() -> None:
    parser = _parser("hermes")
    first = parser.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool", [], [], [], REQUEST)
    assert first is not None and first.content == "Hi "
    assert parser.extract_tool_calls_streaming("Hi <tool", "Hi <tool_c", "_c", [], [], [], REQUEST) is None
    tail = parser.finish_streaming("Hi <tool_c", REQUEST)
    assert tail is not None and tail.content == "<tool_c"


def test_mistral_ids_are_nine_alphanumerics() -> None:
    info = _parser("mistral").extract_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}]', REQUEST)
    assert len(info.tool_calls[0].id) == 9 and info.tool_calls[0].id.isalnum()


class _Token:
    def __init__(self, content: str, special: bool) -> None:
        self.content, self.special = content, special


class _Tokenizer:
    """What adjust_request reads of a fast tokenizer: its added tokens and whether each is special."""

    def __init__(self, added: dict[str, bool]) -> None:
        self.added_tokens_decoder = {i: _Token(t, special) for i, (t, special) in enumerate(added.items())}


def test_adjust_request_keeps_special_tokens_only_when_a_marker_is_one() -> None:
    cls = ToolParserManager.get_tool_parser("hermes")
    assert cls(_Tokenizer({"<tool_call>": True})).adjust_request(REQUEST).skip_special_tokens is False
    # Qwen's <tool_call> is an added token that is not special: detokenizing keeps it anyway
    assert cls(_Tokenizer({"<tool_call>": False, "<|im_end|>": True})).adjust_request(REQUEST).skip_special_tokens
    none = REQUEST.model_copy(update={"tool_choice": "none"})
    assert cls(_Tokenizer({"<tool_call>": True})).adjust_request(none).skip_special_tokens is True


def test_registered_through_the_plugin_manager() -> None:
    pm = get_plugin_manager()
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(pm.tool_parsers())
    info = next(i for i in pm.infos if i.distribution == "pagoda-tool-parsers")
    assert info.kind == "tool_parser" and info.status == "loaded"
    assert "tool_parsers:hermes" in info.provides


def test_tool_parser_plugin_file_registers_a_parser(tmp_path: Any) -> None:
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from pagoda.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager, "
        "ExtractedToolCallInformation\n"
        "@ToolParserManager.register_module('shouty')\n"
        "class Shouty(ToolParser):\n"
        "    def extract_tool_calls(self, model_output, request):\n"
        "        return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output.upper())\n")
    ToolParserManager.import_tool_parser(str(plugin))
    try:
        parser = ToolParserManager.get_tool_parser("shouty")(None)
        assert parser.extract_tool_calls("hi", REQUEST).content == "HI"
    finally:
        ToolParserManager.tool_parsers.pop("shouty", None)
    with pytest.raises(KeyError, match="not registered"):
        ToolParserManager.get_tool_parser("shouty")


@pytest.mark.parametrize(("name", "output"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"),
    ("llama3_json", '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}]"),
    ("pythonic", "[f(a=" + "[" * 100_000 + "]" * 100_000 + ")]"),
])
def test_deeply_nested_output_is_not_a_crash(name: str, output: str) -> None:
    info = _parser(name).extract_tool_calls(output, REQUEST)
    assert not info.tools_called and info.content == output
    # streaming reads brackets without recursion: it gets through (what it sends is not checked here)
    _stream(name, [output[:50_000], output[50_000:]])
