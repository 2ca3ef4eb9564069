"""The KV cache an engine on the CPU gets: by default it follows the model (pagoda_platform_cpu's
default_kv_cache_bytes), an explicit budget is honoured exactly, and no dummy step profiles the
activations (the CPU budget never reads them)."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.worker.model_runner import ModelRunner
from pagoda_platform_cpu.platform import DEFAULT_KVCACHE_GIB, KVCACHE_SPACE_ENV, default_kv_cache_bytes

GiB = 1 << 30


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core.runner


def _engine(path: Any, **kwargs: Any) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, **kwargs)


def test_default_cache_follows_the_model_not_the_old_4_gib(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KVCACHE_SPACE_ENV, raising=False)
    path, _ = tiny_model_dir("llama")
    runner = _runner(_engine(path))
    memory = runner.memory
    expected = default_kv_cache_bytes(runner.config, runner.weights_bytes)
    assert memory.num_blocks == expected // memory.bytes_per_block
    assert memory.kv_cache_bytes < DEFAULT_KVCACHE_GIB * GiB / 4


def test_explicit_budgets_are_exact(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_model_dir("llama")
    monkeypatch.setenv(KVCACHE_SPACE_ENV, "4")  # the old default, asked for: given exactly
    memory = _runner(_engine(path)).memory
    assert memory.num_blocks == 4 * GiB // memory.bytes_per_block
    memory = _runner(_engine(path, kv_cache_memory_bytes=48 << 20)).memory
    assert memory.num_blocks == (48 << 20) // memory.bytes_per_block
    assert _runner(_engine(path, num_kv_blocks=77)).memory.num_blocks == 77


def test_no_activation_profile_step_on_cpu(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch,
                                           hf_greedy: Any) -> None:
    """The CPU budget is absolute, so the max-size dummy step (a 2,048-token batch through the model) is not run."""

    def profiled(self: ModelRunner, *args: Any) -> int:
        raise AssertionError("the CPU platform's budget does not read the activation peak")

    monkeypatch.setattr(ModelRunner, "_profile_activation_peak", profiled)
    path, model = tiny_model_dir("llama")
    llm = _engine(path, kv_cache_memory_bytes=32 << 20)
    memory = _runner(llm).memory
    assert memory.activation_peak_bytes == 0 and not memory.activation_measured
    assert "not measured" in memory.describe()
    prompt = [5, 17, 3, 99, 42, 7]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(model, prompt, 8)
