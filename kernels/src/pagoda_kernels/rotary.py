"""Rotary position embedding with a precomputed cos/sin cache indexed by positions.

``cos_sin_cache``: [max_position, rotary_dim], cos in the first half of each row
and sin in the second (vLLM's layout). Only the first ``rotary_dim`` channels of
each head rotate (partial rotary); the rest pass through. Neox style rotates
channel i with i + rotary_dim/2; GPT-J style rotates the pairs (2i, 2i+1).
"""

from __future__ import annotations

import torch

from pagoda_kernels.dispatch import Impl, use_triton


def _as_heads(x: torch.Tensor, num_tokens: int, head_size: int, name: str) -> torch.Tensor:
    if x.shape[0] != num_tokens or x[0].numel() % head_size:
        raise ValueError(
            f"{name} must be [num_tokens={num_tokens}, num_heads * {head_size}] or [num_tokens, num_heads, {head_size}],"
            f" got {tuple(x.shape)}"
        )
    return x.reshape(num_tokens, -1, head_size)


def _check_rotary_args(positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int) -> None:
    if positions.dim() != 1:
        raise ValueError(f"positions must be [num_tokens], got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] > head_size:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim] with an even rotary_dim <= head_size={head_size}, "
            f"got {tuple(cos_sin_cache.shape)}"
        )


def rotary_embedding_torch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rotary_args(positions, cos_sin_cache, head_size)
    num_tokens = positions.shape[0]
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor, name: str) -> torch.Tensor:
        heads = _as_heads(x, num_tokens, head_size, name)
        out = heads.clone()
        part = heads[..., :rot].float()
        if is_neox:
            x1, x2 = part[..., : rot // 2], part[..., rot // 2 :]
            out[..., :rot] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
            out[..., :rot] = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
        return out.view(x.shape)

    return rotate(query, "query"), rotate(key, "key")


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (query, key), new tensors in the input shapes (vLLM's op rotates in place)."""
    if not use_triton(query.device, impl):
        return rotary_embedding_torch(positions, query, key, head_size, cos_sin_cache, is_neox)
    from pagoda_kernels.triton_impl.rotary import rotary_embedding_triton

    _check_rotary_args(positions, cos_sin_cache, head_size)
    num_tokens = positions.shape[0]
    q = _as_heads(query, num_tokens, head_size, "query")
    k = _as_heads(key, num_tokens, head_size, "key")
    q_out, k_out = rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox)
    return q_out.view(query.shape), k_out.view(key.shape)
