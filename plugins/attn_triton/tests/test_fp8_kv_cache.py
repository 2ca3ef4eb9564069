"""triton_paged over an fp8 KV cache (Triton's interpreter without a GPU): byte-exact writes, scaled reads."""

from __future__ import annotations

import pytest
import torch

from pagoda.testing.attention import Shape, spec_for
from pagoda.testing.attention.fp8 import make_fp8_batch, run_fp8_and_check
from pagoda_attn_triton.backend import TritonPagedAttentionBackend
from pagoda_kernels.dispatch import interpret_mode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DECODE = [(c, 1) for c in (0, 15, 16, 40)]
MIXED = [(20, 1), (0, 9), (17, 6), (3, 1)]


@pytest.mark.skipif(DEVICE == "cpu" and not interpret_mode(), reason="no GPU and TRITON_INTERPRET is off")
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_fp8_cache(lens: list[tuple[int, int]], cache_dtype: torch.dtype) -> None:
    shape = Shape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    batch = make_fp8_batch(lens, shape, torch.float32, cache_dtype, k_scale=0.01, v_scale=0.03, seed=4)
    backend = TritonPagedAttentionBackend(spec_for(shape, torch.float32, device_type="cuda", kv_cache_dtype=cache_dtype))
    run_fp8_and_check(backend, batch, shape, torch.float32, 0.01, 0.03, device=DEVICE)


def test_kernels_refuse_an_fp8_cache_without_scales() -> None:
    from pagoda_kernels import paged_decode_attention, reshape_and_cache

    cache = torch.zeros(2, 3, 4, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), cache, torch.tensor([0]), impl="torch")
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(torch.zeros(1, 4, 16), cache, torch.zeros(1, 1, dtype=torch.int32),
                               torch.tensor([1], dtype=torch.int32), 0.25, impl="torch")
