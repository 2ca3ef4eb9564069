"""The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) against `pagoda serve` on the default
model, with the openai SDK's ``responses.create`` / ``responses.stream`` and the OpenAI Agents SDK: answers equal
to the chat completion of the same conversation, typed stream events that join up to the final response, a
function tool round trip, previous_response_id, the store (GET, DELETE, LRU), text.format json_schema, and the
400s naming what is refused."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("pagoda_structured_xgrammar")
pytest.importorskip("pagoda_tool_parsers")

MODEL = "SmolLM2-135M-Instruct"
STORE_SIZE = 4
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": WEATHER}}]
NAMED = {"type": "function", "name": "get_weather"}
ASK = "What is the weather in Paris?"
HERMES = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>')


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(["--max-model-len", "512", "--max-num-seqs", "8", "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--responses-store-max-entries", str(STORE_SIZE)])


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs).choices[0]


def test_plain_answer_is_the_chat_answer(client: Any) -> None:
    r = client.responses.create(model=MODEL, input="Say hello.", instructions="You are terse.",
                                max_output_tokens=24, temperature=0, metadata={"run": "1"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.metadata == {"run": "1"} and r.instructions == "You are terse."
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [p.type for p in message.content] == ["output_text"]
    chat = _chat(client, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
                 max_tokens=24)
    assert r.output_text == chat.message.content and r.output_text
    assert (r.status == "incomplete") == (chat.finish_reason == "length")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and message.status == "incomplete"
    usage = r.usage
    assert usage.output_tokens <= 24 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0


def _events(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_streamed_text_events_join_up_to_the_response(client: Any) -> None:
    # a structured-outputs choice makes the output end by itself: response.completed
    with client.responses.stream(model=MODEL, input="Greet me.", temperature=0, max_output_tokens=40,
                                 extra_body={"structured_outputs": {"choice": ["Hello there, friend."]}}) as stream:
        events = _events(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) > 1
    assert "".join(d.delta for d in deltas) == "Hello there, friend." == final.output_text
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert {d.item_id for d in deltas} == {final.output[0].id}
    assert final.usage.output_tokens > 0
    whole = client.responses.create(model=MODEL, input="Greet me.", temperature=0, max_output_tokens=40,
                                    extra_body={"structured_outputs": {"choice": ["Hello there, friend."]}})
    assert whole.output_text == final.output_text and whole.usage.output_tokens == final.usage.output_tokens


def test_stream_cut_by_max_output_tokens_ends_incomplete(client: Any) -> None:
    events = _events(client.responses.create(model=MODEL, input="Tell me a long story.", temperature=0,
                                             max_output_tokens=8, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 8
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == _chat(client, [{"role": "user", "content": "Tell me a long story."}],
                                              max_tokens=8).message.content


def _call(response: Any) -> Any:
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    return call


def test_function_tool_round_trip_and_previous_response_id(client: Any) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                    max_output_tokens=60)
    call = _call(first)
    assert first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}
    # the whole conversation sent back, as a stateless client does ...
    full = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK},
                                                       *[item.model_dump(exclude_none=True) for item in first.output],
                                                       result],
                                   tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=24)
    # ... and only the tool's result, the rest from the store
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=TOOLS,
                                      tool_choice="none", temperature=0, max_output_tokens=24)
    assert full.output_text and chained.output_text == full.output_text
    assert chained.previous_response_id == first.id
    assert [item.type for item in full.output] == ["message"]
    # the chat completion of the same conversation says the same
    chat = _chat(client, [{"role": "user", "content": ASK},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}],
                 tools=CHAT_TOOLS, tool_choice="none", max_tokens=24)
    assert chat.message.content == full.output_text


def test_streamed_function_call_events(client: Any) -> None:
    events = _events(client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                             temperature=0, max_output_tokens=60, stream=True))
    final = events[-1].response
    call = _call(final)
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(e.delta for e in pieces) == done.arguments == call.arguments
    assert {e.item_id for e in pieces} == {call.id}
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.call_id == call.call_id


def test_auto_tool_choice_reads_text_then_call(client: Any) -> None:
    """tool_choice auto (the default with tools): the hermes parser splits the text from the call; the
    structured-outputs choice fixes what the model writes."""
    kwargs: dict[str, Any] = dict(model=MODEL, input=ASK, tools=TOOLS, temperature=0, max_output_tokens=150,
                                  extra_body={"structured_outputs": {"choice": [HERMES]}})
    whole = client.responses.create(**kwargs)
    events = _events(client.responses.create(**kwargs, stream=True))
    for response in (whole, events[-1].response):
        assert [item.type for item in response.output] == ["message", "function_call"]
        assert response.output_text == "Checking."
        assert json.loads(_call(response).arguments) == {"city": "Paris", "unit": "celsius"}
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["message", "function_call"]


def test_text_format_json_schema_and_json_object(client: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Invent a person.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    r = client.responses.create(model=MODEL, input="Reply with a JSON object.", temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_object"}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.lstrip().startswith("{")


def test_get_delete_and_the_bounded_store(server: Any, client: Any) -> None:
    r = client.responses.create(model=MODEL, input="Say yes.", temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    deleted = httpx.delete(f"{server.url}/v1/responses/{r.id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        missing = httpx.request(method, f"{server.url}/v1/responses/{r.id}", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, max_output_tokens=4)
    unstored = client.responses.create(model=MODEL, input="Say no.", max_output_tokens=4, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}", timeout=30).status_code == 404
    # the least recently used go first
    ids = [client.responses.create(model=MODEL, input=f"Count to {i}.", max_output_tokens=2).id
           for i in range(STORE_SIZE + 1)]
    found = [httpx.get(f"{server.url}/v1/responses/{i}", timeout=30).status_code for i in ids]
    assert found == [404] + [200] * STORE_SIZE


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input[0].content", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "call_id"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema", "schema"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary", "summary"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "max_tokens", "context length"),
    ({"input": 7}, "input", "input"),
    ({"input": []}, "input", "at least one"),
    ({}, "input", "input"),
])
def test_bad_requests_are_400s_naming_the_field(server: Any, body: dict[str, Any], param: str, needle: str) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_unknown_model_and_previous_response_are_404s(server: Any) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": "nope", "input": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_openai_agents_sdk_runs_a_turn_with_a_tool(server: Any) -> None:
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city.

        Args:
            city: the city
            unit: celsius or fahrenheit
        """
        calls.append((city, unit))
        return json.dumps({"temperature": 21, "unit": unit})

    agents.set_tracing_disabled(True)
    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120))
    # the first turn must call the tool (required); the SDK then resets tool_choice, and the answer after the
    # tool's result is the model's own text under tool_choice auto (the hermes parser)
    agent = Agent(name="weather", instructions="Answer with the weather.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    result = asyncio.run(Runner.run(agent, ASK, max_turns=4))
    assert len(calls) >= 1
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
