"""Bad input a client may send: each answered with a 4xx in OpenAI's error shape, the server serving on.

The default model (SmolLM2-135M-Instruct GGUF, `pagoda serve` with no model) with its
real tokenizer and chat template; a second server started with
--trust-request-chat-template for the request-level template checks.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
BAD_SCHEMA_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "nope"}}}]
# the template: 10^5 x 10^3 iterations of Jinja
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}x"


@pytest.fixture(scope="module")
def server(default_model_server: Any) -> Any:
    return default_model_server


@pytest.fixture(scope="module")
def trusting_server(start_server: Any) -> Any:
    return start_server(["--max-model-len", "512", "--trust-request-chat-template",
                         "--chat-template-render-timeout", "1"])


def _post(server: Any, path: str, body: Any, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return dict(err)


def _still_serving(server: Any) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def _chat(**body: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, "temperature": 0, **body}


# -- token ids outside the vocabulary ---------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", _chat(logit_bias={"1000000": 5}), "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"49152": 1, "3": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "allowed_token_ids": [3, 10**7]}, "allowed_token_ids"),
])
def test_out_of_vocabulary_ids_are_refused_before_the_engine(server: Any, path: str, body: Any, param: str) -> None:
    err = _error(_post(server, path, body))
    assert err["param"] == param and "vocabulary" in err["message"], err
    _still_serving(server)


def test_logit_bias_inside_the_vocabulary_still_applies(server: Any) -> None:
    r = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                                          "logit_bias": {"28": 100}, "return_tokens_as_token_ids": True,
                                          "logprobs": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:28"] * 3


# -- a lone surrogate escape ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_lone_surrogate_is_a_400_json_error(server: Any, path: str) -> None:
    body = (b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
            if path != "/v1/completions" else b'{"prompt": "hi \\udfff there", "max_tokens": 2}')
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    err = _error(r)
    assert "surrogate" in err["message"]
    # a surrogate pair (an emoji written as two escapes) is valid JSON text and still accepted
    ok = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 1}',
                    headers={"content-type": "application/json"}, timeout=30)
    assert ok.status_code == 200, ok.text
    _still_serving(server)


# -- tool_choice -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "needle"), [
    (_chat(tool_choice="required"), "tools"),
    (_chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tools"),
    (_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), "get_time"),
    (_chat(tools=TOOLS, tool_choice="sometimes"), "sometimes"),
    (_chat(tools=[{"type": "function", "function": {"description": "no name"}}], tool_choice="none"), "tools[0]"),
    (_chat(tools=BAD_SCHEMA_TOOLS, tool_choice="required"), "invalid parameters schema"),
    (_chat(tools=BAD_SCHEMA_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "invalid parameters schema"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], tool_choice="required"),
     "must be a JSON schema object"),
    (_chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (_chat(tools=TOOLS, tool_choice="auto"), "--enable-auto-tool-choice"),
    (_chat(tools=TOOLS), "--enable-auto-tool-choice"),  # as vLLM: tools without tool_choice mean "auto"
])
def test_tool_choice_that_cannot_be_honoured_is_a_400(server: Any, body: dict[str, Any], needle: str) -> None:
    err = _error(_post(server, "/v1/chat/completions", body))
    assert needle in err["message"] and err["param"] in ("tools", "tools[0]", "tool_choice",
                                                         "tools[0].function.parameters"), err
    _still_serving(server)


def test_tool_choice_none_and_required_with_no_tools_answer_in_text(server: Any) -> None:
    for body in (_chat(tools=TOOLS, tool_choice="none"), _chat(tools=[], tool_choice="required"), _chat()):
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"] == []


def test_tool_round_trip_renders_with_the_default_template(server: Any) -> None:
    """An assistant turn that only calls a tool (content null), then the tool's answer: SmolLM2's template
    concatenates content, so it gets "" (as vLLM passes it), and the arguments reach the template as an object."""
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
    ]
    r = _post(server, "/v1/chat/completions", _chat(messages=messages, tools=TOOLS, tool_choice="none"))
    assert r.status_code == 200, r.text
    from pagoda.model_loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(None))
    expected = tok.apply_chat_template([USER[0], {"role": "assistant", "content": ""},
                                        {"role": "tool", "content": "sunny, 21 C"}],
                                       tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in expected
    assert r.json()["usage"]["prompt_tokens"] == len(tok(expected, add_special_tokens=False).input_ids)
    bad = [messages[0], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0],
                                                        "function": {"name": "get_weather", "arguments": "{oops"}}]}]
    err = _error(_post(server, "/v1/chat/completions", _chat(messages=bad, tool_choice="none", tools=TOOLS)))
    assert "arguments is not valid JSON" in err["message"], err


# -- prompt_logprobs, length_penalty ------------------------------------------------------------------------


def test_chat_prompt_logprobs_are_returned(server: Any) -> None:
    r = _post(server, "/v1/chat/completions", _chat(prompt_logprobs=2))
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = httpx.post(server.url + "/tokenize", json={"messages": USER}, timeout=30).json()["tokens"]
    plp = body["prompt_logprobs"]
    assert len(plp) == len(tokens) == body["usage"]["prompt_tokens"] and plp[0] is None
    for token, entry in zip(tokens[1:], plp[1:]):
        assert str(token) in entry and 1 <= len(entry) <= 3, entry  # the prompt's own token plus the top 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str) for v in entry.values())
        assert {1, 2} <= {v["rank"] for v in entry.values()}, entry
    assert _post(server, "/v1/chat/completions", _chat()).json()["prompt_logprobs"] is None
    err = _error(_post(server, "/v1/chat/completions", _chat(prompt_logprobs=1, stream=True)))
    assert "stream" in err["message"] and err["param"] == "prompt_logprobs", err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_length_penalty_outside_beam_search_is_refused(server: Any, path: str) -> None:
    body = _chat(length_penalty=0.5) if "chat" in path else {"prompt": "x", "max_tokens": 2, "length_penalty": 2.0}
    err = _error(_post(server, path, body))
    assert err["param"] == "length_penalty" and "beam search" in err["message"], err
    ok = _chat(length_penalty=1.0) if "chat" in path else {"prompt": "x", "max_tokens": 2, "length_penalty": 1.0}
    assert _post(server, path, ok).status_code == 200


# -- request-level chat templates ---------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/chat/completions", {"chat_template": "{{ messages[0].content }}"}),
    ("/tokenize", {"chat_template": "{{ messages[0].content }}"}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}),
])
def test_request_chat_template_refused_without_trust(server: Any, path: str, extra: dict[str, Any]) -> None:
    err = _error(_post(server, path, {"messages": USER, **extra}))
    assert err["param"] in ("chat_template", "chat_template_kwargs"), err
    _still_serving(server)


def test_request_chat_template_with_trust(trusting_server: Any) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ suffix }}"
    tokens = _post(trusting_server, "/tokenize", {"messages": USER, "chat_template": template,
                                                  "chat_template_kwargs": {"suffix": " A:"}}).json()["count"]
    r = _post(trusting_server, "/v1/chat/completions", _chat(chat_template=template,
                                                             chat_template_kwargs={"suffix": " A:"}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == tokens != _post(trusting_server, "/tokenize",
                                                                 {"messages": USER}).json()["count"]


def test_slow_template_is_cut_off_without_blocking_the_server(trusting_server: Any) -> None:
    result: dict[str, Any] = {}

    def slow() -> None:
        started = time.monotonic()
        result["response"] = _post(trusting_server, "/v1/chat/completions", _chat(chat_template=NESTED_LOOPS))
        result["seconds"] = time.monotonic() - started

    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(0.3)
    # while the template renders (a worker thread), the event loop still answers
    health_started = time.monotonic()
    assert httpx.get(trusting_server.url + "/health", timeout=10).status_code == 200
    health_seconds = time.monotonic() - health_started
    worker.join(60)
    err = _error(result["response"])
    assert "render" in err["message"] and err["param"] == "chat_template", err
    # the limit is 1 s; unbounded this template runs for many seconds
    assert result["seconds"] < 4.0, result["seconds"]
    assert health_seconds < result["seconds"], (health_seconds, result["seconds"])
    print(f"\nnested-loop template stopped after {result['seconds']:.2f} s (limit 1 s); /health meanwhile in "
          f"{health_seconds:.3f} s")
    _still_serving(trusting_server)


def test_render_deadline_unit() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pagoda.entrypoints.deadline import DeadlineExceeded, call_with_deadline

    template = ImmutableSandboxedEnvironment().from_string(NESTED_LOOPS)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        call_with_deadline(template.render, 0.3)
    assert time.monotonic() - started < 2.0
    assert call_with_deadline(lambda: json.dumps({"a": 1}), 0.3) == '{"a": 1}'
    time.sleep(0.5)  # a stop that fired late would surface here


def test_an_unexpected_error_is_still_a_json_body() -> None:
    """The safety net under every route: a bug answers 500 in OpenAI's shape, not starlette's plain text."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagoda.entrypoints.openai.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    err = _error(r, 500)
    assert err["type"] == "InternalServerError" and "RuntimeError" in err["message"]
