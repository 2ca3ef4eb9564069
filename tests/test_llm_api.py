"""LLM(...) arguments, model registry resolution and the `pagoda generate` command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda import LLM, SamplingParams


def test_hf_overrides_architectures_picks_another_registered_class(tiny_model_dir) -> None:
    path, _ = tiny_model_dir("llama")
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    base = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=64)
    other = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=64,
                hf_overrides={"architectures": ["MistralForCausalLM"]})
    assert type(other.llm_engine.engine_core.core.runner.model).__name__ == "MistralForCausalLM"
    assert type(base.llm_engine.engine_core.core.runner.model).__name__ == "LlamaForCausalLM"
    assert other.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        base.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_architecture_lists_the_registered_ones(tiny_model_dir) -> None:
    path, _ = tiny_model_dir("llama")
    with pytest.raises(
        ValueError, match=r"NopeForCausalLM.*transformers fallback.*Installed model families:.*LlamaForCausalLM"
    ):
        LLM(model=str(path), skip_tokenizer_init=True, hf_overrides={"architectures": ["NopeForCausalLM"]})


def test_bad_arguments_and_prompts_are_named(tiny_model_dir) -> None:
    path, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(model=str(path), max_num_seqs=0)
    with pytest.raises(ValueError, match="not_an_engine_arg"):
        LLM(model=str(path), not_an_engine_arg=1)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(model=str(path / "does-not-exist"))
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64, num_kv_blocks=32)
    with pytest.raises(ValueError, match=r"prompt \(64 tokens\).*64"):
        llm.generate({"prompt_token_ids": [1] * 64}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)
    # the engine still serves after rejecting bad input
    assert llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.engine_core.core.kv_cache_manager.num_free_blocks == llm.llm_engine.engine_core.core.kv_cache_manager.num_usable_blocks


def test_model_is_resolved_with_the_config_and_stats_come_through_the_client(tiny_model_dir) -> None:
    import torch

    from pagoda.config import EngineArgs

    with pytest.raises(RuntimeError, match="not resolved"):
        _ = EngineArgs().create_engine_config().resolved
    path, _ = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=96, num_kv_blocks=32)
    engine = llm.llm_engine
    resolved = engine.config.resolved
    assert (resolved.max_model_len, resolved.dtype, resolved.vocab_size) == (96, torch.float32, 384)
    assert engine.config.cache_config.block_size is not None
    # the runner runs exactly what the config resolved
    runner = engine.engine_core.core.runner
    assert (runner.max_model_len, runner.dtype, runner.hf_config) == (96, torch.float32, resolved.hf_config)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    busy = engine.get_stats()
    assert busy.num_running_reqs == 1 and busy.kv_cache_usage > 0
    while engine.has_unfinished_requests():
        engine.step()
    idle = engine.get_stats()
    assert (idle.num_running_reqs, idle.num_waiting_reqs, idle.kv_cache_usage) == (0, 0, 0.0)


def test_generate_command_prints_a_completion_of_the_default_model() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli.main", "generate", "The capital of France is",
         "--max-tokens", "8", "--max-model-len", "256", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
