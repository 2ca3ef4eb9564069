"""torch_paged over an fp8 KV cache: saturate(x / scale) written byte-exact, read back scaled."""

from __future__ import annotations

import pytest
import torch

from pagoda.testing.attention import CHUNKED, DECODE, PREFILL, Shape, spec_for
from pagoda.testing.attention.fp8 import make_fp8_batch, run_fp8_and_check
from pagoda_attn_torch.backend import TorchPagedAttentionBackend

MIXED = [(40, 1), (0, 25), (7, 1), (33, 12), (0, 3), (100, 1), (17, 40), (0, 70)]


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [DECODE, PREFILL, CHUNKED, MIXED], ids=["decode", "prefill", "chunked", "mixed"])
def test_fp8_cache(lens: list[tuple[int, int]], dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    shape = Shape(num_heads=4, num_kv_heads=2, head_dim=32)
    batch = make_fp8_batch(lens, shape, dtype, cache_dtype, k_scale=0.02, v_scale=0.005, seed=2, padding_rows=1)
    backend = TorchPagedAttentionBackend(spec_for(shape, dtype, kv_cache_dtype=cache_dtype))
    run_fp8_and_check(backend, batch, shape, dtype, 0.02, 0.005, sliding_window=24 if lens is MIXED else None)


def test_selector_refuses_fp8_to_a_backend_that_does_not_declare_it() -> None:
    from pagoda.attention.interface import AttentionBackend
    from pagoda.attention.selector import _reasons

    spec = spec_for(Shape(), torch.float32, kv_cache_dtype=torch.float8_e4m3fn)
    assert _reasons(TorchPagedAttentionBackend, spec) == []
    assert any("fp8 KV cache" in r for r in _reasons(AttentionBackend, spec))
