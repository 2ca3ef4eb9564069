"""Paged decode and prefill attention: Triton (interpreted) vs the torch reference,
and the torch reference vs a dense attention written independently here."""

import math

import pytest
import torch

from pagoda_kernels import (
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    reshape_and_cache_torch,
)
from pagoda_kernels.testing import make_paged_batch

pytestmark = pytest.mark.usefixtures("interpreted")

HEAD_DIM = 16
BLOCK_SIZE = 4
VARIANTS = {
    "plain": {},
    "window": {"sliding_window": 5},
    "softcap": {"soft_cap": 2.0},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(
    dtype: torch.dtype, tol: dict[str, float], variant: str, num_heads: int, num_kv_heads: int, num_splits: int
) -> None:
    g = torch.Generator().manual_seed(0)
    # 37 tokens over 4 splits of 16-token tiles: three full splits, one empty.
    seq_lens = [1, 37, 9]
    batch = make_paged_batch(seq_lens, [1, 1, 1], num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype, generator=g)
    query = torch.randn(3, num_heads, HEAD_DIM, generator=g).to(dtype)
    args = (query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.25)
    got = paged_decode_attention(*args, **VARIANTS[variant], num_splits=num_splits, impl="triton")
    want = paged_decode_attention_torch(*args, **VARIANTS[variant])
    torch.testing.assert_close(got, want, **tol)


def test_decode_picks_splits_from_max_seq_len() -> None:
    g = torch.Generator().manual_seed(1)
    batch = make_paged_batch([600, 3], [1, 1], 1, HEAD_DIM, 16, generator=g)
    query = torch.randn(2, 2, HEAD_DIM, generator=g)
    args = (query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.25)
    got = paged_decode_attention(*args, max_seq_len=batch.max_seq_len, impl="triton")
    torch.testing.assert_close(got, paged_decode_attention_torch(*args), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2)], ids=["mha", "gqa2"])
def test_prefill_matches_reference(
    dtype: torch.dtype, tol: dict[str, float], variant: str, num_heads: int, num_kv_heads: int
) -> None:
    g = torch.Generator().manual_seed(2)
    # A full prefill spanning two query tiles, a chunk over a cached prefix, a decode, an idle sequence.
    seq_lens, query_lens = [20, 13, 6, 5], [20, 6, 1, 0]
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype, generator=g)
    query = torch.randn(batch.num_tokens, num_heads, HEAD_DIM, generator=g).to(dtype)
    args = (query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.25)
    got = paged_prefill_attention(*args, **VARIANTS[variant], max_query_len=batch.max_query_len, impl="triton")
    want = paged_prefill_attention_torch(*args, **VARIANTS[variant])
    torch.testing.assert_close(got, want, **tol)


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v per head, from full-sequence tensors [L, H, D]."""
    length = q.shape[0]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kv_h = h * k.shape[1] // q.shape[1]
        scores = q[:, h] @ k[:, kv_h].T * scale
        scores = scores + torch.full((length, length), float("-inf")).triu(1)
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, kv_h]
    return out


def test_reference_matches_dense_attention_after_cache_write() -> None:
    """End to end through the cache: write K/V by slot, attend a chunk, compare to dense."""
    g = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, length, cached = 4, 2, 11, 7
    q = torch.randn(length, num_heads, HEAD_DIM, generator=g)
    k = torch.randn(length, num_kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(length, num_kv_heads, HEAD_DIM, generator=g)
    batch = make_paged_batch([length], [length], num_kv_heads, HEAD_DIM, BLOCK_SIZE, generator=g)
    reshape_and_cache_torch(k, v, batch.kv_cache, batch.slot_mapping)
    scale = 1 / math.sqrt(HEAD_DIM)
    want = _dense_causal(q, k, v, scale)[cached:]
    chunk_start = torch.tensor([0, length - cached], dtype=torch.int32)
    args = (q[cached:], batch.kv_cache, batch.block_tables, chunk_start, batch.seq_lens, scale)
    torch.testing.assert_close(paged_prefill_attention_torch(*args), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(paged_prefill_attention(*args, impl="triton"), want, rtol=1e-4, atol=1e-5)


def test_mismatched_heads_are_named() -> None:
    batch = make_paged_batch([4], [1], 2, HEAD_DIM, BLOCK_SIZE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(torch.zeros(1, 3, HEAD_DIM), batch.kv_cache, batch.block_tables, batch.seq_lens, 1.0)
