"""The OpenAI-compatible server, driven over a real socket with the official `openai` SDK.

One `pagoda serve` subprocess on the default model (SmolLM2-135M-Instruct) serves
the whole module; every request keeps max_tokens small.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_model_server: Any) -> Any:
    return default_model_server


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _tokenize(server: Any, **body: Any) -> int:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _metric(server: Any, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"pagoda:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric pagoda:{name} missing from /metrics")


# -- completions --------------------------------------------------------------------------------


def test_completion_greedy_and_usage_match_tokenize(client: openai.OpenAI, server: Any) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    assert out.usage.prompt_tokens == _tokenize(server, prompt=PROMPT)
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completion_prompt_shapes(client: openai.OpenAI, server: Any) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0).choices[0].text
    assert by_ids == by_text
    many = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == by_text[: len(many.choices[0].text)]
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert len(many_ids.choices) == 2
    assert many_ids.usage.prompt_tokens == len(ids) + 2


def test_completion_n_best_of_and_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == sum(4 for _ in out.choices)
    best = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, best_of=3, temperature=1.0)
    assert len(best.choices) == 2
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0 and 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4) and tok in top


def test_stop_string_and_stop_token(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    word = free.split()[1] if len(free.split()) > 1 else free.strip()[:2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[word])
    assert out.choices[0].finish_reason == "stop" and word not in out.choices[0].text
    assert free.startswith(out.choices[0].text)


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


# -- chat ------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def test_chat_and_usage_match_tokenize(client: openai.OpenAI, server: Any) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.prompt_tokens == _tokenize(server, messages=MESSAGES)
    assert out.usage.completion_tokens <= 5


def test_chat_stream_role_first_and_text_matches(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_content_parts_tool_role_and_logprobs(client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}, {"type": "text", "text": "Answer."}]},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "content": "4", "tool_call_id": "call_1"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == out.choices[0].message.content


def test_chat_template_per_request_refused_without_trust(client: openai.OpenAI) -> None:
    # accepted only with --trust-request-chat-template (tests/test_server_bad_input.py), as vLLM
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template": template})


def test_vllm_extra_params(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.8, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 5, "ignore_eos": True,
                    "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [2]},
    )
    assert out.usage.completion_tokens == 5


# -- errors ------------------------------------------------------------------------------------------


def _post(server: Any, path: str, body: Any = None, content: bytes | None = None,
          headers: dict[str, str] | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(server.url + path, content=content, headers=headers or {}, timeout=30)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


BAD_REQUESTS = [
    # (path, body, status, param)
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "top_p": 5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 9}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    # an unknown field is ignored, as vLLM (tests/test_server_dropin.py); a known one of the wrong shape is refused
    ("/v1/completions", {"prompt": "x", "prediction": {"type": "text", "content": "y"}}, 400, "prediction.type"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% if %}"}, 400,
     "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
     400, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p}-{'-'.join(map(str, b))}"[:60] for p, b, _, _ in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server: Any, path: str, body: Any, status: int, param: str | None) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        if status == 400 and param == "top_logprobs":
            assert err["param"] in ("top_logprobs", "logprobs")
        else:
            assert err["param"] == param, err


def test_prompt_longer_than_context_names_both_numbers(server: Any) -> None:
    r = _post(server, "/v1/completions", {"prompt": [1] * 600, "max_tokens": 1})
    assert r.status_code == 400
    assert "512" in r.json()["error"]["message"] and "600" in r.json()["error"]["message"]


def test_malformed_json_wrong_content_type_and_oversized(server: Any) -> None:
    r = _post(server, "/v1/completions", content=b'{"prompt": "x"', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = _post(server, "/v1/completions", content=b'[1, 2]', headers={"content-type": "application/json"})
    assert r.status_code == 400
    big = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    r = _post(server, "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_pooling_endpoints_say_unsupported(server: Any) -> None:
    for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank"):
        r = _post(server, path, {"input": "x"})
        assert r.status_code == 404 and "does not support" in r.json()["error"]["message"], path


def test_server_still_answers_after_errors(client: openai.OpenAI, server: Any) -> None:
    for path, body, _, _ in BAD_REQUESTS:
        _post(server, path, body)
    assert httpx.get(server.url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


# -- info endpoints, metrics -----------------------------------------------------------------------------


def test_info_endpoints(client: openai.OpenAI, server: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/version").json()["version"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    assert httpx.post(server.url + "/detokenize", json={"tokens": [-1]}).status_code == 400


def test_metrics_families(client: openai.OpenAI, server: Any) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                   "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                   "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "request_queue_time_seconds_bucket", "request_success_total", "num_preemptions_total"):
        assert f"pagoda:{family}{{" in text, family
    assert f'model_name="{MODEL}"' in text
    assert _metric(server, "generation_tokens_total") >= 3
    assert 'finished_reason="length"' in text


# -- streaming under load, disconnects -----------------------------------------------------------------------


def _wait_idle(server: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(server, "num_requests_running") + _metric(server, "num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "requests still running after the client left"
        time.sleep(0.2)


def test_client_disconnect_mid_stream_aborts(server: Any) -> None:
    aborted_before = float(httpx.get(server.url + "/metrics").text.split('finished_reason="abort"')[1].split()[1])
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    _wait_idle(server)
    aborted = float(httpx.get(server.url + "/metrics").text.split('finished_reason="abort"')[1].split()[1])
    assert aborted == aborted_before + 1
    assert _metric(server, "kv_cache_usage_perc") == 0.0


def test_64_concurrent_streams_complete(server: Any) -> None:
    async def run() -> list[tuple[int, int, str | None]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[int, int, str | None]:
            stream = await aclient.completions.create(
                model=MODEL, prompt=f"{i} little pigs went to", max_tokens=8, temperature=0.7, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = 0
            reported = -1
            finish = None
            async for c in stream:
                if c.choices:
                    chunks += 1
                    finish = c.choices[0].finish_reason or finish
                if c.usage is not None:
                    reported = c.usage.completion_tokens
            return chunks, reported, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert all(reported == 8 and finish == "length" and 1 <= chunks <= 8 for chunks, reported, finish in results), results
    _wait_idle(server)
