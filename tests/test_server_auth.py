"""API key, CORS and body limit of `pagoda serve`, on a tiny random model served without a tokenizer."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Any, start_server: Any) -> Any:
    path, _ = tiny_model_dir("llama")
    server = start_server([str(path), "--skip-tokenizer-init", "--served-model-name", "tiny", "--max-model-len", "128",
                            "--max-request-body-bytes", "4096", "--allowed-origins", '["https://ok.example"]',
                            "--allowed-hosts", '["127.0.0.1", "*.ok.example"]'],
                           env={"PAGODA_API_KEY": KEY})
    yield server


def test_v1_needs_the_key(keyed_server: Any) -> None:
    url = keyed_server.url
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3]}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    # health and metrics stay open (probes, scrapers)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_with_the_key_token_prompts_work(keyed_server: Any) -> None:
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4
    # without a tokenizer text prompts and chat are refused with a clear 400
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_body_limit_and_cors(keyed_server: Any) -> None:
    url = keyed_server.url
    r = httpx.post(url + "/v1/completions", json={"prompt": [1] * 5000}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    # the Anthropic routes answer the cap, and a wrong key, in Anthropic's shape; x-api-key is a key too
    r = httpx.post(url + "/v1/messages", json={"messages": "x" * 5000}, headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large" and r.json()["type"] == "error"
    r = httpx.post(url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    pre = httpx.options(url + "/v1/completions", headers={"Origin": "https://ok.example",
                                                           "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ok.example"
    bad = httpx.options(url + "/v1/completions", headers={"Origin": "https://evil.example",
                                                           "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in bad.headers


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/pooling"), ("POST", "/score"), ("POST", "/rerank"),
    ("POST", "/v2/rerank"), ("POST", "/classify"), ("GET", "/openapi.json"), ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
])
def test_every_path_but_the_probes_needs_the_key(keyed_server: Any, method: str, path: str) -> None:
    # before, only /v1/* was guarded (vLLM's prefix): these answered anyone
    r = httpx.request(method, keyed_server.url + path, json={"prompt": [1, 2]})
    assert r.status_code == 401, (path, r.status_code, r.text)
    r = httpx.request(method, keyed_server.url + path, json={"tokens": [1, 2]}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code != 401, (path, r.text)
    for open_path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(keyed_server.url + open_path).status_code == 200, open_path


def test_allowed_hosts(keyed_server: Any) -> None:
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed_server.url + "/v1/models", headers=ok).status_code == 200  # Host: 127.0.0.1:PORT
    r = httpx.get(keyed_server.url + "/v1/models", headers={**ok, "Host": "api.ok.example"})
    assert r.status_code == 200
    # a DNS-rebinding page reaches 127.0.0.1 under its own name
    r = httpx.get(keyed_server.url + "/health", headers={"Host": "evil.example:8000"})
    assert r.status_code == 400 and "allowed-hosts" in r.json()["error"]["message"]
