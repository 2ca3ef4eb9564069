"""Real-GPU checks at model-like sizes (bf16, head_dim 128, block 16); skipped without CUDA."""

import pytest
import torch

from pagoda_kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    reshape_and_cache,
    reshape_and_cache_torch,
    silu_and_mul,
    silu_and_mul_torch,
)
from pagoda_kernels.dispatch import interpret_mode
from pagoda_kernels.testing import make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

BF16 = {"rtol": 2e-2, "atol": 2e-2}


@pytest.fixture(autouse=True)
def _compiled_kernels() -> None:
    if interpret_mode():
        pytest.skip("these tests check the compiled kernels; run them without TRITON_INTERPRET=1")


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_long_context(num_splits: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    seq_lens = [4000, 17, 1, 2500]
    batch = make_paged_batch(seq_lens, [1] * 4, 8, 128, 16, torch.bfloat16, "cuda", generator=g)
    query = torch.randn(4, 32, 128, generator=g).to("cuda", torch.bfloat16)
    args = (query, batch.kv_cache, batch.block_tables, batch.seq_lens, 128**-0.5)
    got = paged_decode_attention(*args, max_seq_len=batch.max_seq_len, num_splits=num_splits)
    torch.testing.assert_close(got, paged_decode_attention_torch(*args), **BF16)


@pytest.mark.parametrize("variant", [{}, {"sliding_window": 256}, {"soft_cap": 30.0}])
def test_chunked_prefill_mixed_batch(variant: dict[str, float]) -> None:
    g = torch.Generator().manual_seed(1)
    seq_lens, query_lens = [700, 1300, 64, 90], [700, 300, 1, 1]
    batch = make_paged_batch(seq_lens, query_lens, 8, 128, 16, torch.bfloat16, "cuda", generator=g)
    query = torch.randn(batch.num_tokens, 32, 128, generator=g).to("cuda", torch.bfloat16)
    args = (query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, 128**-0.5)
    got = paged_prefill_attention(*args, **variant, max_query_len=batch.max_query_len)
    torch.testing.assert_close(got, paged_prefill_attention_torch(*args, **variant), **BF16)


def test_elementwise_kernels() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 4096, generator=g).to("cuda", torch.bfloat16)
    r = torch.randn(300, 4096, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(4096, generator=g).to("cuda", torch.bfloat16)
    for got, want in zip(fused_add_rms_norm(x, r, w), fused_add_rms_norm_torch(x, r, w, 1e-6), strict=True):
        torch.testing.assert_close(got, want, **BF16)
    y = torch.randn(300, 2 * 11008, generator=g).to("cuda", torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(y), silu_and_mul_torch(y), **BF16)
    batch = make_paged_batch([40, 3], [40, 3], 8, 128, 16, torch.bfloat16, "cuda", generator=g)
    k = torch.randn(43, 8, 128, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(43, 8, 128, generator=g).to("cuda", torch.bfloat16)
    expected = batch.kv_cache.clone()
    reshape_and_cache(k, v, batch.kv_cache, batch.slot_mapping)
    reshape_and_cache_torch(k, v, expected, batch.slot_mapping)
    assert torch.equal(batch.kv_cache, expected)
