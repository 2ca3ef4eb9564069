"""Checks every paged backend makes the same way: an ``AttentionSpec``'s layout, and a layer's KV cache."""

from __future__ import annotations

import torch

from pagoda.attention.interface import AttentionSpec


def layout_reasons(spec: AttentionSpec) -> list[str]:
    """Why ``spec``'s heads, block size, window, soft cap or ALiBi slopes make no sense; empty when they do.

    The part of ``AttentionBackend.reasons_unsupported`` that does not depend on the backend
    (dtypes and device types, which do, each backend checks itself).
    """
    reasons = []
    if spec.num_heads <= 0 or spec.num_kv_heads <= 0 or spec.head_dim <= 0:
        reasons.append(
            f"num_heads={spec.num_heads}, num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim} must all be positive"
        )
    elif spec.num_heads % spec.num_kv_heads:
        reasons.append(f"num_heads={spec.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}")
    if spec.block_size <= 0:
        reasons.append(f"block_size={spec.block_size} must be positive")
    if spec.sliding_window is not None and spec.sliding_window <= 0:
        reasons.append(f"sliding_window={spec.sliding_window} must be positive")
    if spec.logits_soft_cap is not None and spec.logits_soft_cap <= 0:
        reasons.append(f"logits_soft_cap={spec.logits_soft_cap} must be positive")
    if not spec.causal and spec.sliding_window is not None:
        reasons.append("a sliding window with bidirectional (causal=False) attention is not implemented")
    if spec.alibi_slopes is not None and len(spec.alibi_slopes) != spec.num_heads:
        reasons.append(f"{len(spec.alibi_slopes)} ALiBi slopes for {spec.num_heads} heads (one per head)")
    return reasons


def check_kv_cache(kv_cache: torch.Tensor, block_size: int, key: torch.Tensor) -> None:
    """Raise ValueError unless ``kv_cache`` is a contiguous [2, num_blocks, block_size, kv_heads, head_dim]
    cache for ``key`` ([tokens, kv_heads, head_dim]): new K/V are written through a flat slot view."""
    expected = (2, block_size, key.shape[1], key.shape[2])
    actual = (
        (kv_cache.shape[0], kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]) if kv_cache.dim() == 5 else None
    )
    if actual != expected:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match [2, num_blocks, {block_size}, "
            f"{key.shape[1]}, {key.shape[2]}]"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: new K/V are written through a flat slot view")
