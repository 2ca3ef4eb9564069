"""fp8 KV cache scales a checkpoint provides (compressed-tensors ``kv_cache_scheme`` naming:
``model.layers.N.self_attn.k_scale`` / ``v_scale``), end to end on SmolLM2-135M.

The checkpoint is the embedded default model written out as a Hugging Face directory (bf16,
dequantized from its Q4_1 GGUF), plus a ``kv_scales.safetensors`` holding each layer's scales as
llm-compressor calibrates them: max|k| / 448 and max|v| / 448 (the e4m3 range) over the prompts.
The maxima come from pagoda's ``calculate_kv_scales`` run on the same prompts (it keeps max|k| / 200,
max|v| / 100); transformers' own KV cache gave the same maxima (measured: layer 0 9.9375 / 0.543).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pagoda import LLM, SamplingParams
from pagoda.attention.kv_quant import K_SCALE_CONSTANT, V_SCALE_CONSTANT
from pagoda.model_loader import iter_weights, load_tokenizer, resolve_model_path
from pagoda.model_loader.gguf.config import load_gguf_config

from .test_fp8_kv_cache import PROMPTS, _agreed_prefixes

GREEDY8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
E4M3_MAX = 448.0
ARGS: dict[str, Any] = dict(dtype="bfloat16", max_model_len=512, num_kv_blocks=256)


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY8, use_tqdm=False)]


@pytest.fixture(scope="module")
def scaled_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    path = tmp_path_factory.mktemp("smollm2-kv-scales")
    source = resolve_model_path(None)
    config = load_gguf_config(source.gguf_path)
    assert config is not None
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    load_tokenizer(source).save_pretrained(path)
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in iter_weights(source, "auto", torch.bfloat16)},
              str(path / "model.safetensors"))
    # calibration: each layer's max |k| and |v| over the prompts (all of them prefill in the first step)
    llm = LLM(model=str(path), kv_cache_dtype="fp8", calculate_kv_scales=True, **ARGS)
    _greedy(llm)
    scales: dict[str, float] = {}
    for i, layer in enumerate(_runner(llm).attn_layers):
        scales[f"model.layers.{i}.self_attn.k_scale"] = layer._k_scale_float * K_SCALE_CONSTANT / E4M3_MAX
        scales[f"model.layers.{i}.self_attn.v_scale"] = layer._v_scale_float * V_SCALE_CONSTANT / E4M3_MAX
    del llm
    save_file({n: torch.tensor([v], dtype=torch.float32) for n, v in scales.items()}, str(path / "kv_scales.safetensors"))
    return path, scales


@pytest.fixture(scope="module")
def full_precision_reference(scaled_checkpoint: tuple[Path, dict[str, float]]) -> list[list[int]]:
    """The bf16 cache; the checkpoint's scales are read and ignored (kv_cache_dtype auto), as vLLM does."""
    path, _ = scaled_checkpoint
    llm = LLM(model=str(path), **ARGS)
    layers = _runner(llm).attn_layers
    # loaded, yet no scale reaches the backend: forward passes k_scale / v_scale for an fp8 cache only
    assert all(layer.kv_scales_from_checkpoint for layer in layers)
    assert all(layer._k_scale is None and layer._v_scale is None for layer in layers)
    return _greedy(llm)


def test_checkpoint_scales_are_the_ones_attention_uses(scaled_checkpoint: tuple[Path, dict[str, float]],
                                                       full_precision_reference: list[list[int]],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """SmolLM2 bf16, e4m3 cache with the checkpoint's scales, against the bf16 cache. Measured (load ~12
    on 2 cores, same run): agreed prefixes over 16 tokens 16, 12, 16, 8, 4, 16, 7, 4 (first 8 tokens
    on 5 of 8 prompts, first 4 on 8 of 8); with the scales 1.0 instead: 16, 13, 3, 3, 16, 0, 13, 16
    (first 4 on 6 of 8). Asserted: the first 4 tokens on at least 6 of 8 prompts."""
    path, scales = scaled_checkpoint
    with caplog.at_level(logging.INFO, logger="pagoda.worker.model_runner"):
        llm = LLM(model=str(path), kv_cache_dtype="fp8", **ARGS)
    assert "k_scale / v_scale from the checkpoint (30 attention layer(s)" in caplog.text, caplog.text
    for i, layer in enumerate(_runner(llm).attn_layers):
        # the 0-d tensors every backend (cpu_paged here, torch_paged, triton_paged) is handed
        assert float(layer._k_scale) == pytest.approx(scales[f"model.layers.{i}.self_attn.k_scale"], rel=1e-6)
        assert float(layer._v_scale) == pytest.approx(scales[f"model.layers.{i}.self_attn.v_scale"], rel=1e-6)
        assert layer._k_scale_float != 1.0 and not layer.calculate_kv_scales
    prefixes = _agreed_prefixes(_greedy(llm), full_precision_reference)
    assert sum(n >= 4 for n in prefixes) >= 6, prefixes
