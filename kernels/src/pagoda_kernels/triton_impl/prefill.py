"""Triton varlen attention over the paged cache: prefill and chunked prefill.

The new tokens' K/V are already in the cache (written by ``reshape_and_cache``),
so a chunk on top of a cached prefix reads every key through its block table.
One program per (query tile, sequence, query head); decodes in a mixed batch are
sequences with a one-row query tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels.dispatch import interpret_mode, next_power_of_2
from pagoda_kernels.triton_impl.common import load_paged_tile, soft_cap_scores


@triton.jit
def _prefill_kernel(
    query_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale, soft_cap, sliding_window, k_scale_ptr, v_scale_ptr,
    stride_q_tok, stride_q_head,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt_seq,
    stride_out_tok, stride_out_head,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = m0 + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    q_pos = context_len + rows
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(
        query_ptr + (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
        mask=row_valid[:, None] & d_mask[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile can see: causal up to its last row, windowed from its first.
    hi = tl.minimum(seq_len, context_len + m0 + BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context_len + m0 - sliding_window + 1, 0)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt_seq
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < hi
        k = load_paged_tile(cache_ptr, bt_row, k_pos, k_valid, kv_head, block_size,
                            stride_cache_block, stride_cache_tok, stride_cache_head, d, d_mask)
        v = load_paged_tile(cache_ptr + stride_cache_kv, bt_row, k_pos, k_valid, kv_head, block_size,
                            stride_cache_block, stride_cache_tok, stride_cache_head, d, d_mask)
        if KV_FP8:
            # an fp8 cache read back times its scales, in the query's dtype (as vLLM's Triton attention)
            k = (k.to(tl.float32) * tl.load(k_scale_ptr)).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(v_scale_ptr)).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            scores = soft_cap_scores(scores, soft_cap)
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # Rows with nothing allowed yet keep max=-inf; shift by 0 so they stay exactly zero, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp(row_max - shift)
        p = tl.exp(scores - shift[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_out_tok + head * stride_out_head + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :],
    )


def paged_prefill_attention_triton(
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
    num_tokens, num_heads, head_dim = query.shape
    kv_fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("paged prefill attention needs query and kv_cache contiguous along head_dim")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())  # host sync
    interpreted = interpret_mode()
    # Small tiles keep the interpreter quick and waste little on short chunks.
    block_m = 16 if interpreted or max_query_len <= 16 else 64
    block_n = 16 if interpreted else 64
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        query, kv_cache, block_tables, query_start_loc, seq_lens, out,
        scale, soft_cap or 0.0, sliding_window or 0,
        k_scale if kv_fp8 else query, v_scale if kv_fp8 else query,  # unread without fp8
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        kv_cache.shape[2],
        GROUP=num_heads // kv_cache.shape[3], HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(next_power_of_2(head_dim), 16),
        BLOCK_M=block_m, BLOCK_N=block_n,
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
        UPCAST=interpreted, DOT_PRECISION="ieee" if query.dtype == torch.float32 or interpreted else "tf32",
        KV_FP8=kv_fp8,
    )
    return out
