"""fp8 KV cache end to end: greedy output beside the full-precision cache, and the blocks a budget buys."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "Water boils at",
    "List three fruits:",
    "Translate to French: good morning",
    "The quick brown fox",
]
GREEDY8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _num_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.core.kv_cache_manager.num_blocks


def _greedy(llm: LLM, prompts: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY8, use_tqdm=False)]


@pytest.fixture(scope="module")
def default_model_reference() -> list[list[int]]:
    llm = LLM(dtype="bfloat16", max_model_len=512, num_kv_blocks=256)
    return _greedy(llm, PROMPTS)


def _agreed_prefixes(got: list[list[int]], reference: list[list[int]]) -> list[int]:
    lengths = []
    for a, b in zip(got, reference):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        lengths.append(n)
    return lengths


def test_default_model_fp8_greedy_agrees_with_the_bf16_cache(default_model_reference: list[list[int]]) -> None:
    """SmolLM2-135M in bf16 on cpu_paged, fp8 (e4m3, vLLM's default scale 1.0): at least 6 of 8 prompts
    give the same first 8 tokens (measured: 7 of 8; agreed prefixes 8, 8, 6, 8, 8, 8, 8, 8)."""
    llm = LLM(dtype="bfloat16", max_model_len=512, num_kv_blocks=256, kv_cache_dtype="fp8")
    prefixes = _agreed_prefixes(_greedy(llm, PROMPTS), default_model_reference)
    assert sum(n == 8 for n in prefixes) >= 6, prefixes


@pytest.mark.parametrize("kv_cache_dtype,calculate", [("fp8_e5m2", False), ("fp8_e4m3", True)],
                         ids=["fp8_e5m2", "fp8_e4m3-calculated-scales"])
def test_default_model_coarser_fp8_variants(default_model_reference: list[list[int]], kv_cache_dtype: str,
                                            calculate: bool) -> None:
    """e5m2 keeps 2 mantissa bits, and calculate_kv_scales (vLLM's max|k| / 200 from the first step)
    saturates the larger keys of later prompts: both drift sooner. Measured over 8 tokens: e5m2 4 of 8
    prompts (agreed prefixes 5, 8, 8, 8, 0, 0, 8, 2), calculated scales 3 of 8 (8, 8, 6, 3, 4, 3, 8, 2).
    Asserted: the first two tokens on at least 5 of 8 prompts."""
    llm = LLM(dtype="bfloat16", max_model_len=512, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype,
              calculate_kv_scales=calculate)
    prefixes = _agreed_prefixes(_greedy(llm, PROMPTS), default_model_reference)
    assert sum(n >= 2 for n in prefixes) >= 5, prefixes
    if calculate:
        runner = llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner
        scales = [(layer._k_scale_float, layer._v_scale_float) for layer in runner.attn_layers]
        assert all(k != 1.0 and v != 1.0 for k, v in scales) and not runner.attn_layers[0].calculate_kv_scales


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_tiny_model_cpu_kernel_and_torch_backend_agree_on_fp8(tiny_model_dir: Any, kv_cache_dtype: str) -> None:
    """The C++ kernel (in-register conversion) and torch_paged (torch casts) quantize and read alike.

    A tiny random model's top logits lie too close together for fp8 against float32 (its first 4
    tokens agreed on 5 of 8 prompts with e4m3): that comparison is made on the real model above."""
    path, _ = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 384 for j in range(5 + 3 * i)]} for i in range(8)]
    outs = {
        backend: _greedy(LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                             attention_backend=backend, kv_cache_dtype=kv_cache_dtype), prompts)
        for backend in ("cpu_paged", "torch_paged")
    }
    assert outs["cpu_paged"] == outs["torch_paged"]


def test_same_budget_holds_twice_the_blocks_of_bf16_and_four_times_fp32(tiny_model_dir: Any,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    path, _ = tiny_model_dir("llama")
    # 2 layers x K and V x 16 tokens x 2 KV heads x head_dim 16 = 2048 values a block
    budget = 64 * 2048 * 4
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8_e5m2")):
        with caplog.at_level(logging.INFO, logger="pagoda.worker.model_runner"):
            caplog.clear()
            llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=budget,
                      kv_cache_dtype=kv)
        blocks[dtype, kv] = _num_blocks(llm)
        if kv != "auto":
            assert f"KV cache dtype {kv}" in caplog.text and "the blocks of a" in caplog.text, caplog.text
    assert blocks["float32", "auto"] == 64
    assert blocks["bfloat16", "auto"] == 128
    assert blocks["float32", "fp8"] == 256 == 4 * blocks["float32", "auto"]
    assert blocks["bfloat16", "fp8_e5m2"] == 256 == 2 * blocks["bfloat16", "auto"]


def test_bad_kv_cache_dtype_and_scales_without_fp8_are_refused(tiny_model_dir: Any) -> None:
    path: Path = tiny_model_dir("llama")[0]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(path), skip_tokenizer_init=True, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, calculate_kv_scales=True)
