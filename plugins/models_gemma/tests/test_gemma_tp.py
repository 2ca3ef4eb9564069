"""Gemma with tensor_parallel_size=2 (mp executor, gloo on loopback) against transformers, float32.

Gemma 3: one KV head for two ranks (replicated), per-head q/k norms on each rank's heads, two RoPE tables,
a sliding window, the soft-capped logits gathered over a padded odd vocabulary, a tied LM head.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Gemma3TextConfig

from pagoda.testing.model_parity import build_tiny_model, check_tensor_parallel_parity


def test_gemma3_tp2_greedy_equals_transformers(tmp_path: Path) -> None:
    cfg = Gemma3TextConfig(
        vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=16, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=5.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}},
    )
    report = check_tensor_parallel_parity(build_tiny_model(cfg, seed=7), tmp_path)
    assert report.num_cached_tokens > 0
