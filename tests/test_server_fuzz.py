"""Bounded fuzzing of /v1/completions and /v1/chat/completions with hypothesis-generated bodies.

Bodies mix valid fields, wrong types, out-of-range numbers and unknown keys. The
server must answer every one with 2xx or an OpenAI-style 4xx, never 5xx, never
hang, and stay healthy afterwards.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                 st.text(max_size=8), st.lists(st.integers(-5, 50000), max_size=4), st.dictionaries(st.text(max_size=4),
                                                                                                    st.integers(), max_size=2))
SMALL_INT = st.one_of(st.integers(-3, 5), JUNK)
UNIT = st.one_of(st.floats(-0.5, 1.5, allow_nan=False), JUNK)

COMMON = {
    "model": st.one_of(st.just("SmolLM2-135M-Instruct"), st.text(max_size=6), JUNK),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), JUNK),
    "top_p": UNIT,
    "top_k": SMALL_INT,
    "min_p": UNIT,
    "n": st.one_of(st.integers(-1, 3), JUNK),
    "seed": st.one_of(st.integers(-(2**64), 2**64), JUNK),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), JUNK),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 50000), max_size=3), JUNK),
    "presence_penalty": st.one_of(st.floats(-3, 3, allow_nan=False), JUNK),
    "frequency_penalty": st.one_of(st.floats(-3, 3, allow_nan=False), JUNK),
    "repetition_penalty": st.one_of(st.floats(-1, 3, allow_nan=False), JUNK),
    "min_tokens": SMALL_INT,
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["1", "2", "x", "-4", "99999999"]),
                                            st.floats(-200, 200, allow_nan=False), max_size=2), JUNK),
    "stream": st.booleans(),
    "best_of": SMALL_INT,
    "priority": SMALL_INT,
    "allowed_token_ids": st.one_of(st.lists(st.integers(-1, 60000), max_size=3), JUNK),
    "prompt_logprobs": SMALL_INT,
    "truncate_prompt_tokens": SMALL_INT,
    "unknown_field": JUNK,
}
# Always bounded so a valid body finishes fast; junk here must be refused, not run long.
MAX_TOKENS = st.one_of(st.integers(-2, 4), st.sampled_from([None, "4", 1.5, 10**9]))

COMPLETION = {
    **COMMON,
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=6), max_size=3),
                        st.lists(st.integers(-2, 60000), max_size=5),
                        st.lists(st.lists(st.integers(0, 60000), max_size=3), max_size=2), JUNK),
    "echo": st.one_of(st.booleans(), JUNK),
    "logprobs": st.one_of(st.integers(-1, 25), JUNK),
    "suffix": st.one_of(st.none(), st.text(max_size=3)),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), st.text(max_size=5))},
    optional={"content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}), max_size=2), JUNK),
        "name": st.text(max_size=4)},
)
CHAT = {
    **COMMON,
    "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JUNK),
    "logprobs": st.one_of(st.booleans(), JUNK),
    "top_logprobs": st.one_of(st.integers(-1, 25), JUNK),
    "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(st.sampled_from(["x", "tokenize", "messages"]),
                                                                  st.integers(), max_size=2)),
    "max_completion_tokens": MAX_TOKENS,
}


def _body(fields: dict[str, Any], required: str) -> st.SearchStrategy[dict[str, Any]]:
    optional = {k: v for k, v in fields.items() if k != required}
    return st.fixed_dictionaries({required: fields[required], "max_tokens": MAX_TOKENS}, optional=optional)


def _check(server: Any, path: str, body: dict[str, Any]) -> None:
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    # Encoded here, not by httpx: httpx >= 0.28 refuses non-finite floats client-side, and the
    # fuzzer's inf values (sent as JSON's common Infinity extension) must reach the server.
    content = json.dumps(body)
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=60) as client:
        if body.get("stream") is True:
            with client.stream("POST", server.url + path, content=content, headers=headers) as r:
                assert r.status_code < 500, (body, r.read())
                if r.status_code == 200:
                    lines = [line for line in r.iter_lines() if line]
                    assert lines[-1] == "data: [DONE]", (body, lines[-3:])
                    assert not any('"InternalServerError"' in line for line in lines), (body, lines)
                else:
                    assert "error" in r.read().decode()
            return
        r = client.post(server.url + path, content=content, headers=headers)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)


@FUZZ
@given(body=_body(COMPLETION, "prompt"))
def test_fuzz_completions(default_model_server: Any, body: dict[str, Any]) -> None:
    _check(default_model_server, "/v1/completions", body)


@FUZZ
@given(body=_body(CHAT, "messages"))
def test_fuzz_chat_completions(default_model_server: Any, body: dict[str, Any]) -> None:
    _check(default_model_server, "/v1/chat/completions", body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_healthy_after_fuzzing(default_model_server: Any, path: str) -> None:
    assert httpx.get(default_model_server.url + "/health").status_code == 200
    metrics = httpx.get(default_model_server.url + "/metrics").text
    assert 'pagoda:request_success_total{finished_reason="error"' in metrics
    for line in metrics.splitlines():
        if line.startswith('pagoda:request_success_total{finished_reason="error"'):
            assert float(line.rsplit(" ", 1)[1]) == 0.0


# -- issue 39's hostile shapes: raw bodies the schema-driven bodies above never produce --------------------

def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 2}'


def _schema(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


HOSTILE = st.one_of(
    st.integers(100, 6000).map(_nested),
    # raw bytes inside a string: invalid UTF-8 (ED A0 80 and the like), control characters, stray quotes
    st.binary(min_size=1, max_size=12).map(lambda raw: b'{"prompt": "a' + raw + b'", "max_tokens": 2}'),
    st.sampled_from([b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc0\xaf", b"\xff\xfe"]).map(
        lambda raw: b'{"prompt": "' + raw + b'", "max_tokens": 2}'),
    # prompts far over the context, and long lists that cost per entry
    st.integers(1, 8).map(lambda mb: json.dumps({"prompt": "hello " * (mb * 170_000), "max_tokens": 2}).encode()),
    st.integers(0, 3000).map(lambda n: json.dumps(
        {"prompt": "hi", "max_tokens": 2, "bad_words": [f"w{i}" for i in range(n)]}).encode()),
    st.floats(-1e12, 1e12, allow_nan=False).map(lambda b: json.dumps(
        {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": b}}).encode()),
    # schemas around and far over the bounds
    st.sampled_from([3, 399, 401, 10_000]).map(lambda n: json.dumps(
        {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": _schema(n)}}).encode()),
    st.integers(1, 300_000).map(lambda n: json.dumps(
        {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "a" * n}}).encode()),
)


def _check_raw(server: Any, path: str, content: bytes) -> None:
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code < 500, (content[:200], r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


HOSTILE_FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                        database=None)


@HOSTILE_FUZZ
@given(content=HOSTILE)
def test_fuzz_hostile_completions(default_model_server: Any, content: bytes) -> None:
    _check_raw(default_model_server, "/v1/completions", content)


@HOSTILE_FUZZ
@given(content=HOSTILE)
def test_fuzz_hostile_tokenize(default_model_server: Any, content: bytes) -> None:
    _check_raw(default_model_server, "/tokenize", content)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_server_healthy_after_hostile_fuzzing(default_model_server: Any, path: str) -> None:
    assert httpx.get(default_model_server.url + "/health").status_code == 200
    r = httpx.post(default_model_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
