"""min-p, top-k and top-p: drop unlikely tokens by setting their logits to -inf."""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k without a full sort; rows with ``top_k == vocab`` are left alone."""
    vocab = logits.shape[-1]
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth = kth.masked_fill_((top_k >= vocab).unsqueeze(1), float("-inf"))
    # Ties with the k-th value are kept, as in vLLM.
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Sort once, mask in sorted order, scatter back. Returns the new logits."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # Keep the smallest set of most likely tokens whose mass reaches top_p:
        # drop a token when the mass of everything less likely than it and itself is <= 1 - p.
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return sorted_logits.scatter(dim=-1, index=order, src=sorted_logits)
