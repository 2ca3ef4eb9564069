"""Decoders as pooling models (convert embed / classify / reward) against transformers, tiny Llama, float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagoda import LLM, PoolingParams

PROMPTS = [[1, 17, 33, 4, 9], [1, 9], [1] + list(range(5, 40)), [1, 88, 77, 66, 55, 44], [1, 3, 3, 3]]


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    num_labels=2)


def _save(model: torch.nn.Module, path: Path) -> Path:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def test_convert_embed_is_the_normalized_last_hidden_state(tmp_path: Path) -> None:
    config = _config()
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).eval()
    path = _save(model, tmp_path / "llama")
    with torch.no_grad():
        expected = [model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1] for ids in PROMPTS]
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, runner="pooling", convert="embed")
    assert llm.supported_tasks == ("embed", "token_embed")
    got = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS])
    for out, want in zip(got, expected):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(want, dim=0),
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="generative model"):
        llm.generate(["hi"])
    # the same checkpoint with the default runner still generates, and refuses pooling
    gen = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True)
    assert gen.supported_tasks == ("generate",)
    with pytest.raises(ValueError, match="needs a pooling model"):
        gen.embed([{"prompt_token_ids": PROMPTS[0]}])


def test_sequence_classification_checkpoint_of_a_decoder(tmp_path: Path) -> None:
    config = _config()
    config.architectures = ["LlamaForSequenceClassification"]
    config.pad_token_id = 0
    model = transformers.LlamaForSequenceClassification(config).eval()
    path = _save(model, tmp_path / "llama-cls")
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([ids])).logits[0] for ids in PROMPTS]
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True)  # runner and convert from the name
    assert llm.supported_tasks == ("classify", "token_classify")
    got = llm.classify([{"prompt_token_ids": ids} for ids in PROMPTS], pooling_params=PoolingParams(use_activation=False))
    for out, want in zip(got, expected):
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=0)
    probs = llm.classify([{"prompt_token_ids": PROMPTS[0]}])[0].outputs.probs
    torch.testing.assert_close(torch.tensor(probs), expected[0].softmax(-1), atol=1e-5, rtol=0)


def test_convert_reward_returns_every_token_state(tmp_path: Path) -> None:
    config = _config()
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).eval()
    path = _save(model, tmp_path / "llama")
    with torch.no_grad():
        expected = model.model(input_ids=torch.tensor([PROMPTS[2]])).last_hidden_state[0]
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, runner="pooling", convert="reward")
    out = llm.reward([{"prompt_token_ids": PROMPTS[2]}])[0]
    torch.testing.assert_close(out.outputs.data, expected, atol=1e-4, rtol=0)


def test_runner_errors() -> None:
    from pagoda.config import EngineArgs

    with pytest.raises(ValueError, match="runner"):
        EngineArgs(runner="nope")
