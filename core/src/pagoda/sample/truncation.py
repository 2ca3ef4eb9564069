"""min-p, top-k and top-p: drop unlikely tokens by setting their logits to -inf."""

from __future__ import annotations

import numpy as np
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


# How many of the most likely tokens the candidate search looks at first.
TOP_P_CANDIDATES = 256


def _cutoff_from_sorted(
    sorted_logits: torch.Tensor,
    log_norm: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row lowest logit to keep, from the row's largest logits sorted descending.

    ``log_norm`` [B, 1] is the log-sum-exp of the whole row. Returns (cutoff [B, 1],
    covered [B, 1]); a row is covered when its kept set lies inside ``sorted_logits``.
    """
    count = sorted_logits.shape[-1]
    positions = torch.arange(count, device=sorted_logits.device)
    without_top_p = (top_p >= 1.0).unsqueeze(1)
    with_top_k = torch.zeros_like(without_top_p)
    if top_k is not None:
        # Every active top-k fits in the candidates; top-p then sees the
        # distribution renormalized over the top-k tokens.
        with_top_k = (top_k < vocab).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
        log_norm = torch.where(with_top_k, sorted_logits.logsumexp(dim=-1, keepdim=True), log_norm)
    probs = (sorted_logits - log_norm).exp()
    mass_after = probs.cumsum(dim=-1)
    keep = (mass_after - probs) < top_p.unsqueeze(1)
    keep |= without_top_p
    keep[:, 0] = True
    if top_k is not None:
        keep &= positions < top_k.unsqueeze(1)
    cutoff = sorted_logits.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    covered = (mass_after[:, -1:] >= top_p.unsqueeze(1)) | with_top_k | without_top_p | (count == vocab)
    # Rows without top-p or top-k keep everything.
    cutoff.masked_fill_(without_top_p & ~with_top_k, float("-inf"))
    return cutoff, covered


def apply_top_k_top_p_by_candidates(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    max_top_k: int,
    candidates: int = TOP_P_CANDIDATES,
) -> torch.Tensor:
    """Same tokens kept as ``apply_top_k_top_p``, for CPU tensors, without its index sort.

    Each row's cut-off comes from its ``candidates`` most likely tokens (more if
    a top-k is larger) when its top-p set ends inside them; the other rows (flat
    distributions) sort their values with numpy, several times faster on CPU
    than ``torch.sort``, which also sorts indices. Reads a mask on the host.
    """
    vocab = logits.shape[-1]
    count = min(vocab, max(candidates, max_top_k))
    log_norm = logits.logsumexp(dim=-1, keepdim=True)
    cutoff, covered = _cutoff_from_sorted(logits.topk(count, dim=-1).values, log_norm, top_k, top_p, vocab)
    uncovered = (~covered).squeeze(1).nonzero().squeeze(1)
    if uncovered.numel():
        values = np.sort(logits[uncovered].numpy(), axis=-1)[:, ::-1]
        rows_top_k = None if top_k is None else top_k[uncovered]
        cutoff[uncovered], _ = _cutoff_from_sorted(
            torch.from_numpy(values.copy()), log_norm[uncovered], rows_top_k, top_p[uncovered], vocab
        )
    return logits.masked_fill_(logits < cutoff, float("-inf"))
