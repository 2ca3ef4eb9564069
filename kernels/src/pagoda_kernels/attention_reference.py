"""Plain-torch paged attention: the references the Triton kernels are tested against.

Per-sequence loops keep them obviously right; they are not meant to be fast.
"""

from __future__ import annotations

import torch

from pagoda_kernels.kv_cache import check_kv_scales, dequantize_from_cache


def check_paged_attention_args(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if head_dim != kv_cache.shape[4]:
        raise ValueError(f"query head_dim {head_dim} does not match the KV cache's {kv_cache.shape[4]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"block_tables must be [num_seqs={seq_lens.shape[0]}, max_blocks], got {tuple(block_tables.shape)}"
        )


def gather_sequence_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` keys and values of one sequence: 2 x [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    kv = kv_cache[:, blocks].reshape(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    return kv[0, :seq_len], kv[1, :seq_len]


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """Causal attention of [n, H, D] queries at ``query_positions`` over [L, Hkv, D] keys at 0..L-1."""
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.float(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key_positions = torch.arange(key.shape[0], device=query.device)
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).to(query.dtype)


def paged_prefill_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference varlen attention of flat queries over their paged (cached + new) keys (an fp8
    cache read back times ``k_scale`` / ``v_scale``)."""
    check_paged_attention_args(query, kv_cache, block_tables, seq_lens)
    check_kv_scales(kv_cache, k_scale, v_scale)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        key, value = gather_sequence_kv(kv_cache, block_tables[i], seq_len)
        key, value = dequantize_from_cache(key, k_scale), dequantize_from_cache(value, v_scale)
        positions = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
        out[lo:hi] = attend(query[lo:hi], key, value, positions, scale, sliding_window, soft_cap)
    return out


def paged_decode_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference decode: sequence ``i`` has one query row, at position ``seq_lens[i] - 1``."""
    num_seqs = seq_lens.shape[0]
    if query.shape[0] != num_seqs:
        raise ValueError(f"decode query must have one row per sequence ({num_seqs}), got {query.shape[0]}")
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    return paged_prefill_attention_torch(
        query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, soft_cap,
        k_scale=k_scale, v_scale=v_scale,
    )
