"""Write new keys and values into the paged KV cache through the slot mapping.

kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; token ``t`` goes
to slot ``slot_mapping[t] = block * block_size + offset``; slot -1 is skipped
(padding rows, or tokens whose K/V another step already wrote).
"""

from __future__ import annotations

import torch

from pagoda_kernels.dispatch import Impl, use_triton


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
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference: scatter each row with slot >= 0 into ``kv_cache`` (in place)."""
    check_kv_write_args(key, value, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: Impl = "auto",
) -> None:
    """Write ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into ``kv_cache`` in place."""
    if use_triton(kv_cache.device, impl):
        from pagoda_kernels.triton_impl.kv_cache import reshape_and_cache_triton

        check_kv_write_args(key, value, kv_cache, slot_mapping)
        reshape_and_cache_triton(key, value, kv_cache, slot_mapping)
    else:
        reshape_and_cache_torch(key, value, kv_cache, slot_mapping)
