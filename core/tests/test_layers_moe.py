"""FusedMoE against a per-token reference: routing, renormalisation, the shared expert, edge cases."""

from __future__ import annotations

import pytest
import torch

from pagoda.layers import FusedMoE, fused_topk


def _moe(top_k: int, renormalize: bool, shared: int = 0, num_experts: int = 6) -> FusedMoE:
    moe = FusedMoE(num_experts, top_k, 16, 24, renormalize=renormalize, shared_expert_intermediate_size=shared,
                   dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return moe


def _reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: softmax over experts, top-k, optional renormalisation, weighted sum."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(moe.gate(x[t : t + 1]).float(), dim=-1)[0]
        weights, ids = torch.topk(probs, moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids):
            out[t] += w * moe.experts[int(e)](x[t : t + 1])[0]
        if moe.shared_expert is not None and moe.shared_expert_gate is not None:
            out[t] += torch.sigmoid(moe.shared_expert_gate(x[t : t + 1]))[0] * moe.shared_expert(x[t : t + 1])[0]
    return out


@pytest.mark.parametrize(("top_k", "renormalize", "shared"), [(2, True, 0), (3, False, 0), (1, False, 20)])
def test_matches_per_token_reference(top_k: int, renormalize: bool, shared: int) -> None:
    moe = _moe(top_k, renormalize, shared)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)


def test_experts_without_tokens_and_an_empty_batch() -> None:
    moe = _moe(2, True, num_experts=8)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))  # 2 tokens reach at most 4 of 8 experts
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)
        assert moe(torch.empty(0, 16)).shape == (0, 16)


def test_renormalised_weights_sum_to_one() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    weights, ids = fused_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    raw, _ = fused_topk(logits, 2, renormalize=False)
    assert (raw.sum(-1) < 1).all() and ids.shape == (5, 2)


def test_top_k_outside_the_expert_count_is_refused() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        FusedMoE(8, 9, 16, 24, renormalize=True, dtype=torch.float32)
