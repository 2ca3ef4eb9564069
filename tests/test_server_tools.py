"""Tool calling against `pagoda serve` with the openai SDK: tool_choice required and named (enforced through
structured outputs) streamed and not, arguments that parse and validate; a full round trip (call, tool result,
final answer); tool_choice auto read by the hermes parser (--enable-auto-tool-choice --tool-call-parser hermes),
on outputs made known by a structured-outputs choice; and the 400s."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("pagoda_structured_xgrammar")
pytest.importorskip("pagoda_tool_parsers")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(["--max-model-len", "512", "--max-num-seqs", "8", "--max-n", "4",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--trust-request-chat-template"])


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _collect(stream: Any) -> tuple[str, list[dict[str, Any]], str | None, list[Any]]:
    """Rebuild content and tool calls from a stream as a client does: (content, calls, finish_reason, deltas)."""
    content, calls, finish, deltas = "", [], None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        deltas.append(choice.delta)
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index == len(calls):
                # OpenAI's first delta of a call: index, id, type and name
                assert piece.id and piece.type == "function" and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish, deltas


def test_required_returns_calls_that_validate(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_required_at_temperature_1_with_n_and_one_call_without_parallel_calls(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                       temperature=1.0, seed=7, max_tokens=80, parallel_tool_calls=False)
    for choice in r.choices:
        if choice.finish_reason == "length":
            continue  # cut off inside the array: the partial calls, as the stream delivers them
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=false: the schema allows one
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_named_function_returns_one_call_to_it(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                       max_tokens=80, temperature=0)
    choice = r.choices[0]
    # as vLLM and OpenAI: a forced function keeps finish_reason "stop"
    assert choice.finish_reason == "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _check_calls(choice.message.tool_calls, {"get_weather"})


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_tool_calls_join_up_to_the_same_call(client: Any, tool_choice: Any) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish, deltas = _collect(client.chat.completions.create(stream=True, **kwargs))
    assert content == ""
    assert finish == whole.finish_reason
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # the arguments arrive in several fragments, not in one piece at the end
    assert sum(1 for d in deltas for p in (d.tool_calls or []) if p.function.arguments) > 3


def test_tool_round_trip(client: Any) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=80, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=24, temperature=0).choices[0]
    assert final.message.content and not final.message.tool_calls
    assert final.finish_reason in ("stop", "length")


def test_chat_template_receives_the_tools(server: Any) -> None:
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"
    r = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": TOOLS, "chat_template": template,
                                                   "add_generation_prompt": False}, timeout=60)
    expected = httpx.post(server.url + "/tokenize", json={"prompt": "[get_weather][get_time]" + ASK[0]["content"],
                                                          "add_special_tokens": False}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected.json()["tokens"]


# -- tool_choice auto: the hermes parser on outputs fixed by a structured-outputs choice --------------------

HERMES = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>')


def test_auto_reads_hermes_tool_calls(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150, temperature=0,
                                       extra_body={"structured_outputs": {"choice": [HERMES]}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_auto_streams_hermes_tool_calls(client: Any) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150, temperature=0,
                                            stream=True, extra_body={"structured_outputs": {"choice": [HERMES]}})
    content, calls, finish, _ = _collect(stream)
    assert content == "Checking."  # no piece of "<tool_call>" leaks into the content
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_auto_without_a_call_answers_in_text(client: Any) -> None:
    text = "It is sunny <tool in Paris."
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                      extra_body={"structured_outputs": {"choice": [text]}})
        if stream:
            content, calls, finish, _ = _collect(client.chat.completions.create(stream=True, **kwargs))
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        assert (content, calls, finish) == (text, [], "stop")


# -- 400s --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"tool_choice": "required"}, "tools", "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
     "get_stock"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"a": {"type": 7}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "invalid parameters schema"),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice", "cannot be combined"),
])
def test_bad_tool_requests_are_400s(server: Any, body: dict[str, Any], param: str, needle: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param, error
    assert httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2},
                      timeout=60).status_code == 200


@pytest.mark.parametrize(("args", "needle"), [
    (["--tool-call-parser", "nope"], "tool call parser 'nope' is not registered"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
])
def test_bad_tool_flags_stop_the_start(start_server: Any, args: list[str], needle: str) -> None:
    with pytest.raises(RuntimeError, match="exited") as info:
        start_server(args)
    assert needle in str(info.value)


def test_sdk_parse_with_a_pydantic_function_tool(client: Any) -> None:
    """The SDK's strict function tools (``openai.pydantic_function_tool``) come back as parsed pydantic objects."""
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=20)
        days: int = Field(ge=1, le=7)

    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                      tool_choice="required", max_tokens=80, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert 1 <= call.function.parsed_arguments.days <= 7
