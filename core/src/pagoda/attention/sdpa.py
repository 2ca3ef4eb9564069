"""Attention over K/V already gathered into dense [batch, heads, tokens, head_dim] tensors, in torch.

torch's ``scaled_dot_product_attention`` where it expresses the step; explicit float32
math where it cannot (a logits soft cap; ALiBi in half types). Shared by the backends
that attend gathered K/V in torch (``torch_paged`` for every sequence, ``cpu_paged`` for
long fresh prefills) so that both give the same bits for the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# dtype -> additive mask broadcastable to [batch, heads, queries, keys]; built lazily, cached per step.
MaskFor = Callable[[torch.dtype], torch.Tensor]


def attend(
    queries: torch.Tensor,  # [b, heads, q, head_dim]
    keys: torch.Tensor,  # [b, kv_heads, k, head_dim]
    values: torch.Tensor,
    mask_for: MaskFor | None,  # None (and not causal): every query sees every key
    scale: float,
    logits_soft_cap: float | None,
    causal: bool,
    bias: torch.Tensor | None = None,  # float32 [b, heads, q, k] added to the logits (ALiBi)
) -> torch.Tensor:
    """-> [b, heads, q, head_dim]. ``causal``: the queries are the last q of the k positions, masked causally
    (``mask_for`` is then not read)."""
    num_heads, num_kv_heads = queries.shape[1], keys.shape[1]
    # SDPA takes a bias only as an attn_mask in the query dtype: ALiBi goes through it in
    # float32 alone (a bf16 bias of -30 would be off by 0.1).
    if logits_soft_cap is None and (bias is None or queries.dtype == torch.float32):
        # SDPA's CPU kernels accumulate half types in float32, so softmax stays float32.
        values = values.to(queries.dtype)
        keys = keys.to(queries.dtype)
        mask = None if causal or mask_for is None else mask_for(queries.dtype)
        if bias is not None:
            if causal:
                mask = causal_mask(queries.shape[2], keys.shape[2], queries.device)
            mask = bias if mask is None else bias + mask
            causal = False
        return F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    return _attend_explicit(queries, keys, values, mask_for, scale, logits_soft_cap, causal, bias)


def alibi_bias(slopes: torch.Tensor, relative: torch.Tensor) -> torch.Tensor:
    """[heads] slopes x [b, 1, q, k] key_pos - query_pos -> [b, heads, q, k] float32."""
    return slopes.float().view(1, -1, 1, 1) * relative


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q, k] float32: 0 where key <= query (the queries are the last q of k positions), -inf elsewhere."""
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril_(k_len - q_len)
    return torch.zeros(q_len, k_len, device=device).masked_fill_(~allowed, float("-inf"))


def additive_mask(positions: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """[..., q] absolute query positions -> [..., q, kv_len] float32 mask (0: key visible, -inf: not)."""
    keys = torch.arange(kv_len, device=positions.device)
    pos = positions.unsqueeze(-1)
    allowed = keys <= pos
    if sliding_window is not None:
        allowed &= keys > pos - sliding_window
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=positions.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def _attend_explicit(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask_for: MaskFor | None,
    scale: float,
    cap: float | None,
    causal: bool,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Explicit float32 attention, for what SDPA cannot express (the logits soft-cap; ALiBi in half types)."""
    b, num_heads, q_len, head_dim = queries.shape
    num_kv_heads, k_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    # Query heads h*group..(h+1)*group-1 share KV head h: fold them into the row dimension.
    q = queries.float().reshape(b, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(q, keys.float().transpose(-1, -2))
    if cap is not None:
        scores.mul_(scale / cap).tanh_().mul_(cap)
    else:
        scores.mul_(scale)
    scores = scores.view(b, num_kv_heads, group, q_len, k_len)
    if bias is not None:
        # query head h = kv_head * group + g: the same fold as the scores'
        scores += bias.view(bias.shape[0], num_kv_heads, group, q_len, k_len)
    if causal:
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril_()
        scores.masked_fill_(~allowed, float("-inf"))
    elif mask_for is not None:
        scores += mask_for(torch.float32).view(b, 1, 1, q_len, k_len)
    probs = torch.softmax(scores, dim=-1).view(b, num_kv_heads, group * q_len, k_len)
    out = torch.matmul(probs, values.float())
    return out.view(b, num_heads, q_len, head_dim).to(queries.dtype)
