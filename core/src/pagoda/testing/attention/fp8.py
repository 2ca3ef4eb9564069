"""One attention step over an fp8 KV cache, checked for any backend that serves one.

The batch's cached prefix is stored quantized (``pagoda.attention.kv_quant.quantize_kv``:
saturate(x / scale), rounded to nearest even); the expected output is the dense float64
reference over every token's K/V as the cache holds it (quantized, then scaled back), and the
cache after the step must hold exactly the quantized bytes of the new tokens at their slots.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagoda.attention.interface import AttentionBackend
from pagoda.attention.kv_quant import dequantize_kv, quantize_kv
from pagoda.testing.attention.batch import Batch, Shape, make_batch, params_for
from pagoda.testing.attention.reference import assert_within_tolerance, metadata_to, reference_attention


def make_fp8_batch(
    lens: list[tuple[int, int]],
    shape: Shape,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    k_scale: float,
    v_scale: float,
    seed: int = 0,
    padding_rows: int = 0,
) -> Batch:
    """``make_batch`` with the cache in ``cache_dtype`` (its prefix quantized with the scales)."""
    batch = make_batch(lens, shape, dtype, seed=seed, padding_rows=padding_rows)
    cache = torch.empty(batch.kv_cache.shape, dtype=cache_dtype)
    cache[0] = quantize_kv(batch.kv_cache[0], cache_dtype, k_scale)
    cache[1] = quantize_kv(batch.kv_cache[1], cache_dtype, v_scale)
    batch.kv_cache, batch.initial_cache = cache, cache.clone()
    return batch


def run_fp8_and_check(
    backend: AttentionBackend,
    batch: Batch,
    shape: Shape,
    dtype: torch.dtype,
    k_scale: float,
    v_scale: float,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """One step: output against the reference over the dequantized K/V, and the cache bytes exact."""
    device = torch.device(device or "cpu")
    cache_dtype = batch.kv_cache.dtype
    metadata = backend.prepare(metadata_to(batch.metadata, device))
    batch.kv_cache = batch.kv_cache.to(device)
    params = params_for(
        shape, None, sliding_window,
        k_scale=torch.tensor(k_scale, dtype=torch.float32, device=device),
        v_scale=torch.tensor(v_scale, dtype=torch.float32, device=device),
    )
    scale = params.scale
    out = backend.forward(batch.query.to(device), batch.key.to(device), batch.value.to(device), batch.kv_cache,
                          metadata, params)
    assert out.dtype == dtype and out.shape == batch.query.shape
    out = out.cpu()
    row = 0
    for i, seq in enumerate(batch.sequences):
        as_cached = replace(
            seq,
            keys=dequantize_kv(quantize_kv(seq.keys, cache_dtype, k_scale), torch.float64, k_scale),
            values=dequantize_kv(quantize_kv(seq.values, cache_dtype, v_scale), torch.float64, v_scale),
        )
        expected = reference_attention(as_cached, scale, sliding_window)
        assert_within_tolerance(out[row : row + seq.query_len], expected, dtype,
                                f"sequence {i} ({seq.context_len} cached + {seq.query_len} new)")
        row += seq.query_len
    assert torch.equal(out[row:], torch.zeros_like(out[row:])), "padding rows must come out as zeros"

    expected_cache = batch.initial_cache.clone()
    bs = shape.block_size
    for seq in batch.sequences:
        for t in range(seq.context_len, seq.seq_len):
            expected_cache[0, seq.blocks[t // bs], t % bs] = quantize_kv(seq.keys[t], cache_dtype, k_scale)
            expected_cache[1, seq.blocks[t // bs], t % bs] = quantize_kv(seq.values[t], cache_dtype, v_scale)
    got = batch.kv_cache.cpu().view(torch.uint8)
    mismatched = int((got != expected_cache.view(torch.uint8)).sum())
    assert mismatched == 0, f"{mismatched} fp8 cache bytes differ from saturate(x / scale) rounded to nearest even"
    return out
