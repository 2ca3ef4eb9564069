"""Write new keys and values into the paged KV cache through the slot mapping.

kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; token ``t`` goes
to slot ``slot_mapping[t] = block * block_size + offset``; slot -1 is skipped
(padding rows, or tokens whose K/V another step already wrote).

An fp8 cache (torch.float8_e4m3fn / float8_e5m2) stores saturate(x / scale) rounded to
nearest even, with the layer's ``k_scale`` / ``v_scale`` (0-d float32 tensors), as
pagoda-core's ``pagoda.attention.kv_quant`` defines it.
"""

from __future__ import annotations

import torch

from pagoda_kernels.dispatch import Impl, use_triton

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if kv_cache.dtype in FP8_DTYPES and (k_scale is None or v_scale is None):
        raise ValueError(f"an fp8 KV cache ({kv_cache.dtype}) needs k_scale and v_scale")


def quantize_to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it (fp8: saturate(x / scale); else a cast)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    assert scale is not None
    limit = float(torch.finfo(dtype).max)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_from_cache(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows as attention reads them: fp8 times its scale (float32); others unchanged."""
    if x.dtype not in FP8_DTYPES:
        return x
    assert scale is not None
    return x.float() * scale


def check_kv_write_args(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    expected = (key.shape[0], kv_cache.shape[3], kv_cache.shape[4])
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key and value must be [num_tokens, num_kv_heads, head_dim] = {expected}, "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must hold int32 or int64 slots, got {slot_mapping.dtype}")


def reshape_and_cache_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Reference: scatter each row with slot >= 0 into ``kv_cache`` (in place)."""
    check_kv_write_args(key, value, kv_cache, slot_mapping)
    check_kv_scales(kv_cache, k_scale, v_scale)
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = quantize_to_cache(key[keep], kv_cache.dtype, k_scale)
    kv_cache[1, blocks, offsets] = quantize_to_cache(value[keep], kv_cache.dtype, v_scale)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: Impl = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into ``kv_cache`` in place
    (an fp8 cache: quantized with ``k_scale`` / ``v_scale``)."""
    if use_triton(kv_cache.device, impl):
        from pagoda_kernels.triton_impl.kv_cache import reshape_and_cache_triton

        check_kv_write_args(key, value, kv_cache, slot_mapping)
        check_kv_scales(kv_cache, k_scale, v_scale)
        reshape_and_cache_triton(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        reshape_and_cache_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)
