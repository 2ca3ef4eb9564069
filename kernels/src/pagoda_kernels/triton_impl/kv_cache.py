"""Triton KV-cache write: one program per (token, kv head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels.dispatch import next_power_of_2
from pagoda_kernels.triton_impl.common import saturate_round_fp8


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_tok, stride_key_head,
    stride_value_tok, stride_value_head,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    block_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, E4M3: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    k = tl.load(key_ptr + token * stride_key_tok + head * stride_key_head + d, mask=d_mask)
    v = tl.load(value_ptr + token * stride_value_tok + head * stride_value_head + d, mask=d_mask)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_tok + head * stride_cache_head + d
    if FP8:
        # saturate(x / scale): a plain cast would give NaN past the format's range
        k = saturate_round_fp8(k, tl.load(k_scale_ptr), FP8_MAX, E4M3)
        v = saturate_round_fp8(v, tl.load(v_scale_ptr), FP8_MAX, E4M3)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=d_mask)


def reshape_and_cache_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("reshape_and_cache needs key, value and kv_cache contiguous along head_dim")
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, kv_cache, slot_mapping,
        k_scale if fp8 else key, v_scale if fp8 else key,  # unread without fp8
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim),
        FP8=fp8, FP8_MAX=float(torch.finfo(kv_cache.dtype).max) if fp8 else 0.0,
        E4M3=kv_cache.dtype == torch.float8_e4m3fn,
    )
