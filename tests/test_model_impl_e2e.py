"""model_impl with the installed families: Llama through the transformers fallback matches pagoda's own
implementation, the log says which one serves, and `pagoda plugins list` names families and the fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import transformers
from typer.testing import CliRunner

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.cli.main import app
from pagoda.testing.model_parity import build_tiny_model, mixed_prompts, save_tiny_model


def _generate(model_dir: Path, model_impl: str) -> tuple[LLM, list]:
    llm = LLM(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float32", model_impl=model_impl,
        max_model_len=256, max_num_batched_tokens=32, enable_prefix_caching=True, block_size=16, num_kv_blocks=256,
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(256, seed=3)]
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_llama_forced_through_the_fallback_matches_the_pagoda_implementation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    model_dir = save_tiny_model(build_tiny_model(config, seed=0), tmp_path / "llama")
    with caplog.at_level(logging.INFO, logger="pagoda.worker.model_runner"):
        own_llm, own = _generate(model_dir, "auto")
        fallback_llm, fallback = _generate(model_dir, "transformers")
    assert "Serving LlamaForCausalLM with pagoda-models-llama (pagoda implementation)" in caplog.text
    assert "Serving LlamaForCausalLM through the transformers fallback (pagoda-models-transformers)" in caplog.text
    assert type(own_llm.llm_engine.engine_core.core.runner.model).__name__ == "LlamaForCausalLM"
    assert type(fallback_llm.llm_engine.engine_core.core.runner.model).__name__ == "TransformersForCausalLM"
    for a, b in zip(own, fallback, strict=True):
        ours, theirs = a.outputs[0], b.outputs[0]
        assert ours.token_ids == theirs.token_ids
        for step_a, step_b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t].logprob - step_b[t].logprob) < 1e-3 for t in step_a)


def test_plugins_list_names_the_installed_families_and_the_fallback() -> None:
    result = CliRunner().invoke(app, ["plugins", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    section = result.output.partition("\narchitectures:\n")[2].partition("\nplatforms:\n")[0]
    rows = [line.split(None, 2) for line in section.splitlines() if line.strip()]
    assert ["LlamaForCausalLM", "pagoda-models-llama", "pagoda"] in rows
    fallback = next(line for line in section.splitlines() if "(any other)" in line)
    assert "pagoda-models-transformers" in fallback and "transformers fallback" in fallback


def test_plugins_list_architecture_says_why_bloom_cannot_be_served() -> None:
    runner = CliRunner()
    served = runner.invoke(app, ["plugins", "list", "-a", "GPTBigCodeForCausalLM", "-a", "LlamaForCausalLM"])
    assert served.exit_code == 0, served.output
    assert "Serving GPTBigCodeForCausalLM through the transformers fallback (pagoda-models-transformers)" in served.output
    assert "Serving LlamaForCausalLM with pagoda-models-llama (pagoda implementation)" in served.output
    refused = runner.invoke(app, ["plugins", "list", "-a", "BloomForCausalLM"])
    assert refused.exit_code == 1
    assert "_supports_attention_backend is False" in refused.output
    assert "Installed model families:" in refused.output and "pagoda-models-llama: LlamaForCausalLM" in refused.output
