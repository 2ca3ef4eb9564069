"""cpu_paged over an fp8 KV cache: quantized writes byte-exact, reads converted in registers."""

from __future__ import annotations

import pytest
import torch

from pagoda.testing.attention import CHUNKED, DECODE, PREFILL, Shape, params_for, spec_for
from pagoda.testing.attention.fp8 import make_fp8_batch, run_fp8_and_check
from pagoda_attn_cpu.backend import CpuPagedAttentionBackend

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MIXED = [(40, 1), (0, 25), (7, 1), (33, 12), (0, 3), (100, 1), (17, 40), (0, 70)]


def backend(shape: Shape, dtype: torch.dtype, cache_dtype: torch.dtype) -> CpuPagedAttentionBackend:
    return CpuPagedAttentionBackend(spec_for(shape, dtype, kv_cache_dtype=cache_dtype))


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [DECODE, PREFILL, CHUNKED, MIXED], ids=["decode", "prefill", "chunked", "mixed"])
def test_fast_path_head_dim(lens: list[tuple[int, int]], dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    # head_dim 64 (SmolLM2's, GQA 9/3): the register-resident path reads the fp8 rows in place
    shape = Shape(num_heads=9, num_kv_heads=3, head_dim=64)
    batch = make_fp8_batch(lens, shape, dtype, cache_dtype, k_scale=0.02, v_scale=0.05, seed=3, padding_rows=2)
    run_fp8_and_check(backend(shape, dtype, cache_dtype), batch, shape, dtype, 0.02, 0.05)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [16, 40], ids=["d16", "d40-generic"])
def test_generic_path_and_sliding_window(head_dim: int, cache_dtype: torch.dtype) -> None:
    shape = Shape(num_heads=4, num_kv_heads=2, head_dim=head_dim)
    batch = make_fp8_batch(MIXED, shape, torch.float32, cache_dtype, k_scale=0.5, v_scale=2.0, seed=5)
    run_fp8_and_check(backend(shape, torch.float32, cache_dtype), batch, shape, torch.float32, 0.5, 2.0,
                      sliding_window=20)


def test_out_of_range_values_saturate() -> None:
    # scale 0.004: |x| / scale reaches ~1000, past e4m3's 448; the cache holds +-448, never NaN
    shape = Shape(num_heads=4, num_kv_heads=2, head_dim=64)
    batch = make_fp8_batch(DECODE, shape, torch.float32, torch.float8_e4m3fn, k_scale=0.004, v_scale=0.004, seed=7)
    run_fp8_and_check(backend(shape, torch.float32, torch.float8_e4m3fn), batch, shape, torch.float32, 0.004, 0.004)
    assert not torch.isnan(batch.kv_cache.float()).any()
    assert batch.kv_cache.float().abs().max() == 448


def test_fp8_cache_without_scales_is_refused() -> None:
    shape = Shape(head_dim=64)
    batch = make_fp8_batch(DECODE, shape, torch.float32, torch.float8_e4m3fn, 1.0, 1.0)
    attention = backend(shape, torch.float32, torch.float8_e4m3fn)
    metadata = attention.prepare(batch.metadata)
    with pytest.raises(ValueError, match="k_scale"):
        attention.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, params_for(shape, 0.125))


def test_avx2_build_matches() -> None:
    """The AVX2 + F16C conversions (8 lanes), built for a Haswell-class CPU, run here too (AVX-512 is a superset)."""
    from pagoda.cpp_extension import CppExtension
    from pagoda_attn_cpu import kernel as kernel_module

    ext = CppExtension("pagoda_attn_cpu_f32_kve4m3_d64_avx2", "pagoda_attn_cpu", ["csrc/paged_attention.cpp"],
                       cflags=("-O3", "-march=haswell", "-fopenmp", "-ffp-contract=fast", "-DPAGODA_ATTN_DTYPE=0",
                               "-DPAGODA_ATTN_CACHE=3", "-DPAGODA_ATTN_HEAD_DIM=64"))
    avx2 = kernel_module.PagedAttentionKernel(ext.library(), torch.float32, torch.float8_e4m3fn)
    shape = Shape(num_heads=9, num_kv_heads=3, head_dim=64)
    batch = make_fp8_batch(MIXED, shape, torch.float32, torch.float8_e4m3fn, k_scale=0.02, v_scale=0.05, seed=11)

    class Avx2Backend(CpuPagedAttentionBackend):
        def __init__(self, spec: object) -> None:
            super().__init__(spec)  # type: ignore[arg-type]
            self._kernel = avx2

    run_fp8_and_check(Avx2Backend(spec_for(shape, torch.float32, kv_cache_dtype=torch.float8_e4m3fn)), batch, shape,
                      torch.float32, 0.02, 0.05)
