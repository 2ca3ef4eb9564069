"""Triton paged attention for decode (one query token per sequence).

One program per (sequence, KV head, split): the query heads that share the KV
head are packed as rows of one tile (GQA), so each K/V tile is read once for the
whole group. Long contexts are split across programs (split-K) to fill the GPU
when the batch is small; a second kernel merges the splits by log-sum-exp.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from pagoda_kernels.dispatch import interpret_mode, next_power_of_2
from pagoda_kernels.triton_impl.common import load_paged_tile, soft_cap_scores

TILE_TOKENS = 64
# Below this many tokens per split, splitting costs more in the reduce than it gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(
    query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale, soft_cap, sliding_window, k_scale_ptr, v_scale_ptr,
    stride_q_tok, stride_q_head,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt_seq,
    stride_out_tok, stride_out_head,
    block_size,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - sliding_window, 0)
    span = seq_len - first
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), TILE) * TILE
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt_seq
    for start in range(lo, hi, TILE):
        pos = start + tl.arange(0, TILE)
        valid = pos < hi
        k = load_paged_tile(cache_ptr, bt_row, pos, valid, kv_head, block_size,
                            stride_cache_block, stride_cache_tok, stride_cache_head, d, d_mask)
        v = load_paged_tile(cache_ptr + stride_cache_kv, bt_row, pos, valid, kv_head, block_size,
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
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp(row_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    if NUM_SPLITS == 1:
        out = acc / row_sum[:, None]
        tl.store(
            out_ptr + seq * stride_out_tok + heads[:, None] * stride_out_head + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # Partials: [num_seqs, num_heads, NUM_SPLITS, (HEAD_DIM_PAD)] fp32, contiguous.
        # An empty split leaves max=-inf, sum=0, acc=0, which the reduce weighs as zero.
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + row, row_max, mask=g_mask)
        tl.store(part_sum_ptr + row, row_sum, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_out_tok, stride_out_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_PAD)
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    maxes = tl.load(part_max_ptr + base + s)
    sums = tl.load(part_sum_ptr + base + s)
    top = tl.max(maxes, axis=0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - top))
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM_PAD + d[None, :])
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(out_ptr + seq * stride_out_tok + head * stride_out_head + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@cache
def _multiprocessor_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split long contexts only while the grid is too small to fill the device."""
    # Under the interpreter (CPU tensors) pretend a tiny device so splitting still gets exercised.
    sm_count = _multiprocessor_count(device.index) if device.type == "cuda" else 4
    programs = max(num_seqs * num_kv_heads, 1)
    want = -(-2 * sm_count // programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    splits = min(want, by_length, MAX_SPLITS)
    # A power of two (the reduce kernel tiles over splits), rounded down.
    return 1 if splits <= 1 else 1 << (splits.bit_length() - 1)


def paged_decode_attention_triton(
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
    num_seqs, num_heads, head_dim = query.shape
    kv_fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("paged decode attention needs query and kv_cache contiguous along head_dim")
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())  # a host sync: pass max_seq_len on the hot path
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=query.device)
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the kernel when NUM_SPLITS == 1
    interpreted = interpret_mode()
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, seq_lens, out,
        part_acc, part_max, part_sum,
        scale, soft_cap or 0.0, sliding_window or 0,
        k_scale if kv_fp8 else query, v_scale if kv_fp8 else query,  # unread without fp8
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        kv_cache.shape[2],
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(next_power_of_2(group), 16),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, TILE=16 if interpreted else TILE_TOKENS,
        NUM_SPLITS=num_splits, USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
        # The interpreter computes bf16/fp16 arithmetic wrongly; it runs fp32 tiles instead.
        UPCAST=interpreted, DOT_PRECISION="ieee" if query.dtype == torch.float32 or interpreted else "tf32",
        KV_FP8=kv_fp8,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        )
    return out
