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


@triton.jit
def saturate_round_fp8(x, scale, FP8_MAX: tl.constexpr, E4M3: tl.constexpr):
    """saturate(x / scale) rounded to nearest even onto the fp8 grid, as float32: its cast to fp8 is exact.

    Rounding here, not in the cast, makes every backend agree bit for bit: Triton's interpreter
    rounds a value that carries into the next exponent down instead (126.9 -> 64 in e4m3).
    """
    a = tl.minimum(tl.abs(x.to(tl.float32) / scale), FP8_MAX)
    u = a.to(tl.int32, bitcast=True)
    if E4M3:
        # 3 mantissa bits: drop 20; subnormals are multiples of 2^-9 = ulp(2^14)
        rounded = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) << 20
        sub = (a + 16384.0) - 16384.0
        normal = a >= 0.015625
    else:
        # 2 mantissa bits: drop 21; subnormals are multiples of 2^-16 = ulp(2^7)
        rounded = ((u + 0xFFFFF + ((u >> 21) & 1)) >> 21) << 21
        sub = (a + 128.0) - 128.0
        normal = a >= 0.00006103515625
    r = tl.where(normal, rounded.to(tl.float32, bitcast=True), sub)
    return tl.where(x < 0, -r, r)
