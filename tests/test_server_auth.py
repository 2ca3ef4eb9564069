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
                            "--max-request-body-bytes", "4096", "--allowed-origins", '["https://ok.example"]'],
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
    pre = httpx.options(url + "/v1/completions", headers={"Origin": "https://ok.example",
                                                           "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ok.example"
    bad = httpx.options(url + "/v1/completions", headers={"Origin": "https://evil.example",
                                                           "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in bad.headers
