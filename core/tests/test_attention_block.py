"""pagoda.layers.RotaryAttention over a paged cache against the same block written densely."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagoda.layers import TORCH_LAYER_OPS, RMSNorm, RotaryAttention, RotaryEmbedding, rope_config_from_hf
from pagoda.testing.paged_kv import PagedKVHarness

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS = 32, 4, 2, 8, 1e-6


def _block(qk_norm: bool, calls: list[tuple[int, int, int]] | None = None) -> RotaryAttention:
    def norm(heads: int, total: int, first: int) -> RMSNorm:
        if calls is not None:
            calls.append((heads, total, first))
        return RMSNorm(HEAD_DIM, EPS, torch.float32)

    block = RotaryAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, torch.float32, layer_idx=0, scale=0.3,
                            qkv_bias=True, o_proj_bias=True, qk_norm=norm if qk_norm else None)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + (1.0 if param.ndim == 1 else 0.0))
    return block


def _dense(block: RotaryAttention, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The block for one causal sequence: projections, per-head norms, RoPE, softmax attention (GQA), output."""
    t = x.shape[0]
    qkv = x @ block.qkv_proj.weight.T + block.qkv_proj.bias
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = q.reshape(t, HEADS, HEAD_DIM), k.reshape(t, KV_HEADS, HEAD_DIM), v.reshape(t, KV_HEADS, HEAD_DIM)
    if block.q_norm is not None and block.k_norm is not None:
        def rms(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight

        q, k = rms(q, block.q_norm.weight), rms(k, block.k_norm.weight)
    if cos_sin is not None:
        q, k = q.clone(), k.clone()
        TORCH_LAYER_OPS.rotary_neox_(q, *cos_sin)
        TORCH_LAYER_OPS.rotary_neox_(k, *cos_sin)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v).reshape(t, HEADS * HEAD_DIM)
    return out @ block.o_proj.weight.T + block.o_proj.bias


@pytest.mark.parametrize(("qk_norm", "rotary"), [(True, True), (False, True), (False, False)])
def test_block_matches_the_dense_block(qk_norm: bool, rotary: bool) -> None:
    block = _block(qk_norm)
    cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, max_position_embeddings=64)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11)
    cos_sin = RotaryEmbedding(rope_config_from_hf(cfg), torch.float32).cos_sin(positions) if rotary else None
    harness = PagedKVHarness(block)
    _, metadata = harness.step([(harness.new_sequence(11), 11)])
    with torch.inference_mode():
        got = block(x, cos_sin, metadata)
    torch.testing.assert_close(got, _dense(block, x, cos_sin), atol=1e-4, rtol=0)
    if not rotary:  # the control: rotation changes the result
        with_rope = RotaryEmbedding(rope_config_from_hf(cfg), torch.float32).cos_sin(positions)
        assert (got - _dense(block, x, with_rope)).abs().max() > 1e-2


def test_the_norm_factory_is_told_this_ranks_heads() -> None:
    calls: list[tuple[int, int, int]] = []
    block = _block(qk_norm=True, calls=calls)
    assert calls == [(HEADS, HEADS, 0), (KV_HEADS, KV_HEADS, 0)]  # one rank: all heads, from head 0
    assert (block.num_heads, block.num_kv_heads, block.q_size, block.kv_size) == (4, 2, 32, 16)


def test_heads_that_kv_heads_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        RotaryAttention(HIDDEN, 4, 3, HEAD_DIM, torch.float32, layer_idx=0, scale=1.0)


def test_alibi_slopes_and_window_reach_the_attention_layer() -> None:
    block = RotaryAttention(HIDDEN, HEADS, HEADS, HEAD_DIM, torch.float32, layer_idx=3, scale=1.0,
                            sliding_window=5, logits_soft_cap=30.0, alibi_slopes=(0.5, 0.25, 0.125, 0.0625))
    assert block.attn.alibi_slopes_tuple() == (0.5, 0.25, 0.125, 0.0625)
    assert (block.attn.sliding_window, block.attn.logits_soft_cap, block.attn.layer_idx) == (5, 30.0, 3)
