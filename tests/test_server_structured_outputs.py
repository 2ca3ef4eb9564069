"""Structured outputs over HTTP: response_format, vLLM's structured_outputs and guided_* fields, the openai SDK's
``chat.completions.parse``, and a bad constraint answered with a 400 (default model, xgrammar backend)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

pytest.importorskip("pagoda_structured_xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server(default_model_server: Any) -> Any:
    return default_model_server


def _post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 80, "temperature": 0, **extra}


def test_chat_response_format_json_schema_and_json_object(server: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = _post(server, "/v1/chat/completions", _chat("Give a person as JSON.", response_format=fmt))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    r = _post(server, "/v1/chat/completions", _chat('Repeat {"a": 1} as JSON.', max_tokens=120,
                                                    response_format={"type": "json_object"}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # SmolLM2 may nest objects past max_tokens under json_object (no schema bounds it); what it wrote is JSON so far
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


def test_completions_structured_outputs_and_guided_fields(server: Any) -> None:
    base = {"prompt": "My phone number is", "max_tokens": 20, "temperature": 0}
    r = _post(server, "/v1/completions", {**base, "structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"])
    r = _post(server, "/v1/completions", {**base, "guided_choice": ["red", "blue"], "n": 1})
    assert r.json()["choices"][0]["text"] in ("red", "blue")
    r = _post(server, "/v1/completions", {**base, "guided_json": SCHEMA, "max_tokens": 80})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)
    r = _post(server, "/v1/completions", {**base, "guided_grammar": 'root ::= "a" | "b"'})
    assert r.json()["choices"][0]["text"] in ("a", "b")
    r = _post(server, "/v1/completions", {**base, "n": 3, "temperature": 1.0, "seed": 1,
                                          "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "p", "schema": SCHEMA}},
                                          "structured_outputs": None, "max_tokens": 80})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_response_format_structural_tag(server: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    # xgrammar's form: one tag that must be written, from the first token
    forced = {"type": "structural_tag", "format": {"type": "tag", "begin": "<function=weather>",
                                                   "content": {"type": "json_schema", "json_schema": schema},
                                                   "end": "</function>"}}
    r = _post(server, "/v1/chat/completions", _chat("What is the weather in Paris?", response_format=forced))
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    match = re.fullmatch(r"<function=weather>(.*)</function>", content, re.S)
    assert match is not None, content
    jsonschema.validate(json.loads(match.group(1)), schema)
    # vLLM's (OpenAI-style) form: free text until a trigger, then the structure
    triggered = {"type": "structural_tag", "triggers": ["<function="],
                 "structures": [{"begin": "<function=weather>", "schema": schema, "end": "</function>"}]}
    r = _post(server, "/v1/chat/completions", _chat("hi", max_tokens=10, response_format=triggered))
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/chat/completions", _chat("hi", response_format={"type": "structural_tag", "triggers": []}))
    assert r.status_code == 400 and "structural_tag" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body, needle", [
    ({"guided_json": {"type": "nope"}}, "invalid structured_outputs.json"),
    ({"guided_regex": "a(b"}, "invalid structured_outputs.regex"),
    ({"guided_grammar": "root ::= ("}, "invalid structured_outputs.grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "one structured output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_bad_constraints_are_400(server: Any, body: dict[str, Any], needle: str) -> None:
    r = _post(server, "/v1/chat/completions", _chat("hi", **body))
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_openai_sdk_parse_with_pydantic(server: Any) -> None:
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    completion = client.chat.completions.parse(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "A person as JSON."}],
        response_format=Person, max_tokens=80, temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person), completion
