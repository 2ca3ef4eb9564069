"""Mixture-of-experts models with tensor_parallel_size=2 (mp executor, gloo on loopback) against transformers.

Every rank holds every expert with half its intermediate width; the routed and shared experts' partial
sums are all-reduced once per block, the router and the shared expert's gate replicated.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2MoeConfig

from pagoda.testing.model_parity import build_tiny_model, check_tensor_parallel_parity


def test_qwen2_moe_shared_expert_tp2_greedy_equals_transformers(tmp_path: Path) -> None:
    cfg = Qwen2MoeConfig(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         mlp_only_layers=[1], norm_topk_prob=False)
    check_tensor_parallel_parity(build_tiny_model(cfg, seed=3), tmp_path, llm_kwargs={"model_impl": "pagoda"})
