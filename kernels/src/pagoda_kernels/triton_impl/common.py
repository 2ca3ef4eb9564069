"""Small jit helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap_scores(scores, cap):
    # cap * tanh(scores / cap), with tanh from exp: portable to every backend and the interpreter.
    x = scores / cap
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def load_paged_tile(
    cache_ptr, block_table_row_ptr, positions, valid, kv_head,
    block_size, stride_block, stride_tok, stride_head, d, d_mask,
):
    """[TILE, HEAD_DIM_PAD] rows of one KV head at token ``positions`` through the block table."""
    block_ids = tl.load(block_table_row_ptr + positions // block_size, mask=valid, other=0).to(tl.int64)
    offsets = (positions % block_size).to(tl.int64)
    ptrs = (
        cache_ptr
        + block_ids[:, None] * stride_block
        + offsets[:, None] * stride_tok
        + kv_head * stride_head
        + d[None, :]
    )
    return tl.load(ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0)
