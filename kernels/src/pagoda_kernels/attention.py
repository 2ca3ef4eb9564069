"""Paged attention entry points: Triton on GPUs, the torch reference elsewhere."""

from __future__ import annotations

import torch

from pagoda_kernels.attention_reference import (
    check_paged_attention_args,
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
)
from pagoda_kernels.dispatch import Impl, use_triton
from pagoda_kernels.kv_cache import check_kv_scales


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    impl: Impl = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence ([num_seqs, num_heads, head_dim]) over its paged keys.

    ``max_seq_len`` (host int) sizes the split-K grid without a device sync;
    ``num_splits`` (a power of two) overrides that choice.
    """
    if not use_triton(query.device, impl):
        return paged_decode_attention_torch(
            query, kv_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, max_seq_len, num_splits,
            k_scale, v_scale,
        )
    from pagoda_kernels.triton_impl.decode import paged_decode_attention_triton

    check_paged_attention_args(query, kv_cache, block_tables, seq_lens)
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"decode query must have one row per sequence ({seq_lens.shape[0]}), got {query.shape[0]}")
    check_kv_scales(kv_cache, k_scale, v_scale)
    return paged_decode_attention_triton(
        query, kv_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, max_seq_len, num_splits,
        k_scale, v_scale,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,
    impl: Impl = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of flat queries [num_tokens, num_heads, head_dim] over cached + new keys.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, which
    sit at the end of its ``seq_lens[i]`` tokens (a chunk over a cached prefix).
    """
    if not use_triton(query.device, impl):
        return paged_prefill_attention_torch(
            query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, soft_cap, max_query_len,
            k_scale, v_scale,
        )
    from pagoda_kernels.triton_impl.prefill import paged_prefill_attention_triton

    check_paged_attention_args(query, kv_cache, block_tables, seq_lens)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1 = {seq_lens.shape[0] + 1}], got {tuple(query_start_loc.shape)}"
        )
    check_kv_scales(kv_cache, k_scale, v_scale)
    return paged_prefill_attention_triton(
        query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, soft_cap, max_query_len,
        k_scale, v_scale,
    )
