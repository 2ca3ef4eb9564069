"""Generation defaults from the model, end to end: offline (LLM) and over HTTP; the default model stops."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

# The README's quick-start request, as a new user sends it (plus a seed, so the test is repeatable).
README_CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}]}
IM_END = 2  # <|im_end|>: SmolLM2's EOS and its chat template's end of turn


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, _ = tiny_model_dir("llama")
    path = tmp_path_factory.mktemp("gen-defaults")
    for file in src.iterdir():
        shutil.copy(file, path / file.name)
    save_tiny_tokenizer(path, 384)
    # greedy and 4 tokens unless a request says otherwise
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 4}))
    return path


def test_default_model_readme_chat_stops_at_end_of_turn(default_model_server) -> None:
    body = {**README_CHAT, "seed": 0, "max_tokens": 64, "logprobs": True, "return_tokens_as_token_ids": True}
    reply = httpx.post(default_model_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["message"]["content"].strip()
    assert choice["logprobs"]["content"][-1]["token"] == f"token_id:{IM_END}"
    assert "the embedded default model's recommended sampling" in default_model_server.output()


def test_server_applies_the_models_defaults_to_unset_fields(model_with_generation_config: Path, start_server) -> None:
    server = start_server([str(model_with_generation_config), "--dtype", "float32", "--max-model-len", "128",
                           "--num-kv-blocks", "64"])
    url = server.url + "/v1/completions"
    unset = httpx.post(url, json={"prompt": "w5 w6 w7"}, timeout=60).json()
    assert unset["usage"]["completion_tokens"] == 4  # max_new_tokens, not the completion API's 16
    # as in vLLM, max_new_tokens caps an explicit max_tokens too
    capped = httpx.post(url, json={"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0}, timeout=60).json()
    assert capped["usage"]["completion_tokens"] == 4
    assert capped["choices"][0]["text"] == unset["choices"][0]["text"]  # the default was greedy
    shorter = httpx.post(url, json={"prompt": "w5 w6 w7", "max_tokens": 2}, timeout=60).json()
    assert shorter["usage"]["completion_tokens"] == 2
    # n=2 is refused under the model's greedy default, and accepted once the request samples
    assert httpx.post(url, json={"prompt": "w5", "n": 2}, timeout=60).status_code == 400
    sampled = httpx.post(url, json={"prompt": "w5", "n": 2, "temperature": 1.0, "seed": 1}, timeout=60)
    assert sampled.status_code == 200, sampled.text
    assert "Default sampling parameters have been overridden by the model's generation config" in server.output()


def test_generation_config_vllm_keeps_pagodas_defaults(model_with_generation_config: Path) -> None:
    from pagoda import LLM

    llm = LLM(model=str(model_with_generation_config), generation_config="vllm", dtype="float32",
              max_model_len=64, num_kv_blocks=16)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (1.0, 16)
