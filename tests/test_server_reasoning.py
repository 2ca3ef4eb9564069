"""`pagoda serve --reasoning-parser deepseek_r1`: reasoning_content split from content, whole and streamed.

A tiny random Llama with the default model's tokenizer plus <think> / </think> (ids 49152 / 49153) stands in for
a reasoning model; an llguidance Lark grammar with token references makes it write the tags as those tokens, with
``enable_in_reasoning`` so the grammar holds from the first token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("pagoda_structured_llguidance")
pytest.importorskip("pagoda_reasoning_parsers")

GRAMMAR = "start: <[49152]> /[a-z]{2,6}/ <[49153]> /[0-9]{3}/"


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tf

    from pagoda.model_loader import resolve_model_path
    from pagoda.model_loader.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(None))
    tok.add_tokens(["<think>", "</think>"])  # not special: they stay in the text, as in DeepSeek-R1's tokenizer
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [49152, 49153]
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-reasoner")
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(start_server: Any, reasoning_model: Path) -> Any:
    return start_server([str(reasoning_model), "--reasoning-parser", "deepseek_r1", "--max-model-len", "256",
                         "--num-kv-blocks", "64", "--max-num-seqs", "4",
                         "--structured-outputs-config", '{"backend": "guidance", "enable_in_reasoning": true}'])


def _body(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "What is 6 * 7?"}], "max_tokens": 30, "temperature": 1.0,
            "seed": 3, "structured_outputs": {"grammar": GRAMMAR}, **extra}


def test_reasoning_content_is_split_from_content(server: Any) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=_body(n=2), timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        message = choice["message"]
        assert re.fullmatch("[a-z]{2,6}", message["reasoning_content"]), message
        assert message["reasoning"] == message["reasoning_content"]
        assert re.fullmatch("[0-9]{3}", message["content"]), message


def test_streamed_deltas_split_the_same_way(server: Any) -> None:
    whole = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=120).json()["choices"][0]["message"]
    reasoning, content = "", ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=_body(stream=True), timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content


def test_without_a_reasoning_parser_reasoning_is_null(default_model_server: Any) -> None:
    r = httpx.post(default_model_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, timeout=120)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["reasoning"] is None and message["content"]


def _responses_events(server: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_responses_api_answers_with_a_reasoning_item(server: Any) -> None:
    """/v1/responses: the reasoning becomes a reasoning item ahead of the message, whole and streamed."""
    chat = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=120).json()["choices"][0]["message"]
    body = {"input": "What is 6 * 7?", "max_output_tokens": 30, "temperature": 1.0, "seed": 3,
            "structured_outputs": {"grammar": GRAMMAR}}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    events = _responses_events(server, {**body, "stream": True})
    for response in (r.json(), events[-1]["response"]):
        reasoning, message = response["output"]
        assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
        assert reasoning["content"] == [{"type": "reasoning_text", "text": chat["reasoning_content"]}]
        assert message["content"][0]["text"] == chat["content"]
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == chat["reasoning_content"]
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["reasoning", "message"]
