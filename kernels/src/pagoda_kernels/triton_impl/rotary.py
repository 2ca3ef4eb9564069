"""Triton rotary embedding: one program per token rotates all its query and key heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels.dispatch import next_power_of_2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_x_tok, stride_x_head, stride_out_tok, stride_out_head,
                  cos, sin, num_heads, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  IS_NEOX: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        first = i
        second = i + HALF
    else:
        first = 2 * i
        second = 2 * i + 1
    mask = (h[:, None] < num_heads) & (i[None, :] < HALF)
    src = x_ptr + token * stride_x_tok + h[:, None] * stride_x_head
    dst = out_ptr + token * stride_out_tok + h[:, None] * stride_out_head
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first[None, :], (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    stride_qo_tok, stride_qo_head, stride_ko_tok, stride_ko_head,
    stride_cache_pos, num_q_heads, num_k_heads,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    row = cache_ptr + pos * stride_cache_pos
    cos = tl.load(row + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q_tok, stride_q_head, stride_qo_tok, stride_qo_head,
                  cos, sin, num_q_heads, Q_HEADS_PAD, HALF, HALF_PAD, IS_NEOX)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k_tok, stride_k_head, stride_ko_tok, stride_ko_head,
                  cos, sin, num_k_heads, K_HEADS_PAD, HALF, HALF_PAD, IS_NEOX)


def rotary_embedding_triton(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hk, D] -> rotated copies (channels past rotary_dim copied as they are)."""
    if query.stride(2) != 1 or key.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_embedding needs query, key and cos_sin_cache contiguous along the last dim")
    rotary_dim = cos_sin_cache.shape[1]
    head_size = query.shape[2]
    # Only the rotated channels are written by the kernel; start from a copy when some pass through.
    q_out = query.clone() if rotary_dim < head_size else torch.empty_like(query)
    k_out = key.clone() if rotary_dim < head_size else torch.empty_like(key)
    num_tokens = positions.shape[0]
    if num_tokens:
        half = rotary_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, query, key, q_out, k_out, cos_sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos_sin_cache.stride(0), query.shape[1], key.shape[1],
            Q_HEADS_PAD=next_power_of_2(query.shape[1]), K_HEADS_PAD=next_power_of_2(key.shape[1]),
            HALF=half, HALF_PAD=next_power_of_2(half), IS_NEOX=is_neox,
        )
    return q_out, k_out
