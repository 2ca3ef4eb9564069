"""The NeoX family with tensor_parallel_size=2 (mp executor, gloo on loopback) against transformers, float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import GPTNeoXConfig, PhiConfig, StableLmConfig

from pagoda.testing.model_parity import build_tiny_model, check_tensor_parallel_parity

CONFIG = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256)


def _configs() -> dict[str, Any]:
    return {
        # the checkpoint's per-head interleaved query_key_value, regrouped, then split by heads
        "gpt-neox-parallel": GPTNeoXConfig(**CONFIG),
        # a shared qk LayerNorm, the LM head's bias split with its rows
        "phi-qk-layernorm-gqa": PhiConfig(**CONFIG, num_key_value_heads=2, qk_layernorm=True),
        # per-head q/k norms: each rank holds its own heads' rows
        "stablelm-per-head-qk-norm-gqa": StableLmConfig(**CONFIG, num_key_value_heads=2, qk_layernorm=True,
                                                        use_qkv_bias=True),
    }


@pytest.mark.parametrize("case", list(_configs()))
def test_neox_family_tp2_greedy_equals_transformers(tmp_path: Path, case: str) -> None:
    check_tensor_parallel_parity(build_tiny_model(_configs()[case], seed=3), tmp_path,
                                 llm_kwargs={"model_impl": "pagoda"})
