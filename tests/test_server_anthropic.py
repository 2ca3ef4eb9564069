"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against `pagoda serve` on the default
model, driven by the anthropic SDK unchanged: plain, with a system prompt, stop sequences, max_tokens, streamed
(the SDK's stream helper assembles the events), a forced tool call and the tool_result turn after it, token
counts, the API key by x-api-key, and Anthropic error bodies for bad shapes. Greedy answers are compared with
/v1/chat/completions on the same conversation: both run the same chat path."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("pagoda_structured_xgrammar")
pytest.importorskip("pagoda_tool_parsers")

MODEL = "SmolLM2-135M-Instruct"
KEY = "anthropic-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"type": "tool", "name": "get_weather"}
# the SDK no longer has sampling arguments (Anthropic's newer models take none); the server still reads them
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(["--max-model-len", "512", "--max-num-seqs", "8", "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes"], env={"PAGODA_API_KEY": KEY})


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    # the SDK sends the key as x-api-key
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _chat(server: Any, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_message_is_the_chat_answer(client: Any, server: Any) -> None:
    r = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    chat = _chat(server, messages=ASK, max_tokens=24, **GREEDY)
    assert r.content[0].text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"]
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert r.stop_reason == expected and r.stop_sequence is None


def test_system_prompt_string_and_blocks(client: Any, server: Any) -> None:
    system = "You are a pirate. Answer like one."
    as_string = client.messages.create(model=MODEL, max_tokens=20, system=system, messages=ASK, extra_body=GREEDY)
    as_blocks = client.messages.create(model=MODEL, max_tokens=20, system=[{"type": "text", "text": system}],
                                       messages=ASK, extra_body=GREEDY)
    chat = _chat(server, messages=[{"role": "system", "content": system}, *ASK], max_tokens=20, **GREEDY)
    assert _text(as_string) == _text(as_blocks) == chat["choices"][0]["message"]["content"]
    # (SmolLM2's template writes its own system prompt when there is none: the counts differ, either way)
    plain = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert as_string.usage.input_tokens == chat["usage"]["prompt_tokens"] != plain


def test_max_tokens_stops_with_max_tokens(client: Any) -> None:
    r = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_stop_sequences(client: Any) -> None:
    whole = _text(client.messages.create(model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY))
    words = whole.split()
    assert len(words) > 3, whole
    stop = " " + words[2]
    r = client.messages.create(model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY, stop_sequences=[stop, "zzqx"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert _text(r) == whole[:whole.index(stop)]  # the stop string itself is left out, as Anthropic leaves it


def test_streamed_text_and_final_message(client: Any) -> None:
    kwargs = dict(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 3  # token by token, not one piece at the end
    assert "".join(pieces) == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.id.startswith("msg_")
    assert (final.usage.input_tokens, final.usage.output_tokens) == \
        (whole.usage.input_tokens, whole.usage.output_tokens)


def test_stream_event_order(client: Any) -> None:
    events = list(client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY, stream=True))
    types = [e.type for e in events]  # the SDK drops the ping (test_stream_sse_has_event_lines sees it)
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0
    assert all(e.delta.type == "text_delta" and e.index == 0 for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8


def test_stream_sse_has_event_lines(server: Any) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == name[len("event: "):]
    names = [b.split("\n")[0][len("event: "):] for b in blocks]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def _tool_use(message: Any) -> Any:
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1, message.content
    return uses[0]


def test_forced_tool_call_then_tool_result_turn(client: Any, server: Any) -> None:
    first = client.messages.create(model=MODEL, max_tokens=60, messages=WEATHER_ASK, tools=TOOLS,
                                   tool_choice=FORCED, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    call = _tool_use(first)
    assert call.name == "get_weather" and call.id
    assert isinstance(call.input, dict)
    jsonschema.validate(call.input, WEATHER)

    # streamed: the input arrives as input_json_delta fragments the SDK joins to the same object
    with client.messages.stream(model=MODEL, max_tokens=60, messages=WEATHER_ASK, tools=TOOLS, tool_choice=FORCED,
                                extra_body=GREEDY) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert _tool_use(final).input == call.input and _tool_use(final).name == "get_weather"
    assert len(deltas) > 3 and all(d.delta.type == "input_json_delta" for d in deltas)

    # the tool's result goes back in a user turn; tool_choice none: the model answers in text
    turn = [*WEATHER_ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "18 degrees and sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=24, messages=turn, tools=TOOLS,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens") and _text(second)
    # the same conversation in OpenAI's shape answers the same: the tool result reached the prompt as a tool message
    chat = _chat(server, max_tokens=24, **GREEDY, tool_choice="none",
                 tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                          "parameters": t["input_schema"]}} for t in TOOLS],
                 messages=[*WEATHER_ASK,
                           {"role": "assistant", "content": None, "tool_calls": [{
                               "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                           {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}])
    assert _text(second) == chat["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"] > first.usage.input_tokens


def test_tool_choice_any_calls_a_tool(client: Any) -> None:
    r = client.messages.create(model=MODEL, max_tokens=80, messages=WEATHER_ASK, tools=TOOLS,
                               tool_choice={"type": "any"}, extra_body=GREEDY)
    if r.stop_reason == "max_tokens":
        pytest.fail(f"the call was cut off: {r.content}")
    assert r.stop_reason == "tool_use"
    jsonschema.validate(_tool_use(r).input, WEATHER)


def test_count_tokens_is_the_prompt_the_server_runs(client: Any) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, system="Be brief.", messages=WEATHER_ASK, tools=TOOLS)
    counted = client.messages.count_tokens(**kwargs).input_tokens
    ran = client.messages.create(max_tokens=40, tool_choice=FORCED, extra_body=GREEDY, **kwargs)
    assert counted == ran.usage.input_tokens > 0
    # a longer system prompt, more
    longer = client.messages.count_tokens(**{**kwargs, "system": "Be brief. Answer in French."}).input_tokens
    assert longer > counted


def test_output_config_json_schema(client: Any) -> None:
    from typing import Literal

    from pydantic import BaseModel

    class Forecast(BaseModel):
        unit: Literal["celsius", "fahrenheit"]
        sunny: bool

    # the SDK's parse helper sends output_config.format and reads the text back into the model
    parsed = client.messages.parse(model=MODEL, max_tokens=60, messages=WEATHER_ASK, output_format=Forecast,
                                   extra_body=GREEDY)
    assert parsed.stop_reason == "end_turn"
    assert isinstance(parsed.parsed_output, Forecast)
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    for field in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):
        r = client.messages.create(model=MODEL, max_tokens=30, messages=WEATHER_ASK, extra_body={**GREEDY, **field})
        jsonschema.validate(json.loads(_text(r)), schema)


def test_api_key(server: Any) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == 401
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": KEY}, AUTH):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    # the key in x-api-key opens the OpenAI routes too
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)


def test_metadata_is_accepted_and_logged(client: Any, server: Any) -> None:
    r = client.messages.create(model=MODEL, max_tokens=2, messages=ASK, metadata={"user_id": "u-1"})
    assert r.usage.output_tokens == 2
    assert "metadata" in server.output()


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [IMAGE]}]}, 400, "image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "video"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "tool_use"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "thinking"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "nope"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "tools"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "web_search_20250305"),
    ({"max_tokens": 4, "messages": ASK, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, 400,
     "mcp_servers"),
    ({"max_tokens": 4, "messages": ASK, "temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "output_config": {"format": {"type": "xml"}}}, 400, "output_config"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": FORCED,
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400, "tool_choice"),
    ({"max_tokens": 100000, "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "model": "claude-nonexistent"}, 404, "claude-nonexistent"),
], ids=["no-max-tokens", "zero-max-tokens", "no-messages", "system-role", "image", "unknown-block",
        "tool-use-in-user", "thinking", "unknown-tool", "any-without-tools", "server-tool", "mcp", "bad-temperature",
        "bad-output-format", "output-format-and-forced-tool",
        "over-context", "unknown-model"])
def test_bad_shapes_get_anthropic_errors(server: Any, body: dict[str, Any], status: int, words: str) -> None:
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error"
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert words in err["error"]["message"], err


def test_bad_bodies_and_sdk_errors(server: Any, client: Any) -> None:
    for content, ctype in ((b"{not json", "application/json"), (b"[1, 2]", "application/json"),
                           (b"{}", "text/plain")):
        r = httpx.post(server.url + "/v1/messages", content=content,
                       headers={"x-api-key": KEY, "content-type": ctype}, timeout=60)
        assert 400 <= r.status_code < 500 and r.json()["type"] == "error", r.text
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": [IMAGE]},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=ASK)
    # the server still serves after them
    assert client.messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens == 2


def _fuzz_strategy() -> Any:
    from hypothesis import strategies as st

    junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                     st.text(max_size=6), st.lists(st.integers(-5, 50), max_size=3),
                     st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
    block = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=10), junk)}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=4), "name": st.text(max_size=4),
                               "input": st.one_of(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                                                  junk)}),
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.one_of(st.text(max_size=4), junk),
                               "content": st.one_of(st.text(max_size=6), junk)}),
        st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "document", "x"])}), junk)
    message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), junk),
                                     "content": st.one_of(st.text(max_size=12), st.lists(block, max_size=3), junk)})
    tool = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["f", "bad name"]), junk),
                                  "input_schema": st.one_of(st.just({"type": "object"}), junk)},
                                 optional={"type": st.sampled_from(["custom", "bash_20250124"])})
    return st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), junk),
         "max_tokens": st.one_of(st.integers(-2, 4), st.sampled_from([None, "4", 1.5, 10**9]))},
        optional={"model": st.one_of(st.just(MODEL), st.text(max_size=5), junk),
                  "system": st.one_of(st.text(max_size=8), st.lists(block, max_size=2), junk),
                  "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=2), junk),
                  "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), junk),
                  "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), junk),
                  "top_k": st.one_of(st.integers(-3, 5), junk),
                  "tools": st.one_of(st.lists(tool, max_size=2), junk),
                  "tool_choice": st.one_of(st.fixed_dictionaries(
                      {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                      optional={"name": st.sampled_from(["f", "g"])}), junk),
                  "thinking": st.one_of(st.sampled_from([{"type": "disabled"}, {"type": "enabled"}]), junk),
                  "metadata": junk, "stream": st.booleans()})


def test_fuzzed_bodies_get_a_message_or_an_anthropic_4xx(server: Any) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(body=_fuzz_strategy())
    def check(body: dict[str, Any]) -> None:
        body.setdefault("model", MODEL)
        headers = {"x-api-key": KEY, "content-type": "application/json"}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", server.url + "/v1/messages", content=json.dumps(body), headers=headers) as r:
                raw = r.read().decode()
        assert r.status_code < 500, (body, raw)
        if r.status_code >= 400:
            err = json.loads(raw)
            assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, raw
        elif body.get("stream") is True:
            assert raw.rstrip().split("\n")[0] == "event: message_start" and "event: message_stop" in raw, raw
        else:
            assert json.loads(raw)["type"] == "message"

    check()
    assert httpx.get(server.url + "/health").status_code == 200
