"""GPT-NeoX, Phi and StableLM end to end through ``pagoda.LLM`` against transformers (shared parity check).

Greedy tokens and top-5 logprobs of a mixed batch of 13 prompts (1 to 120 tokens), float32, chunked prefill
under a 32-token step budget, prefix caching on; each architecture in its residual, bias and q/k-norm variants,
all with partial rotary embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import GPTNeoXConfig, PhiConfig, StableLmConfig

from pagoda.testing.model_parity import build_tiny_model, check_parity

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
)


def _configs() -> dict[str, Any]:
    return {
        # rotary_pct 0.25 of a 16-wide head: 4 rotated channels
        "gpt-neox-parallel": GPTNeoXConfig(**CONFIG),
        "gpt-neox-sequential-tied": GPTNeoXConfig(
            **CONFIG, use_parallel_residual=False, rotary_pct=0.5, tie_word_embeddings=True
        ),
        "phi": PhiConfig(**CONFIG),
        "phi-qk-layernorm-gqa": PhiConfig(**CONFIG, num_key_value_heads=2, qk_layernorm=True),
        "stablelm-qkv-bias": StableLmConfig(**CONFIG, num_key_value_heads=2, use_qkv_bias=True),
        "stablelm-qk-layernorm-parallel": StableLmConfig(
            **CONFIG, num_key_value_heads=4, qk_layernorm=True, use_parallel_residual=True
        ),
    }


@pytest.mark.parametrize("case", list(_configs()))
def test_every_neox_family_architecture(tmp_path: Path, case: str) -> None:
    # model_impl="pagoda": this plugin's classes, never the transformers fallback
    report = check_parity(build_tiny_model(_configs()[case], seed=1), tmp_path, llm_kwargs={"model_impl": "pagoda"})
    assert report.num_cached_tokens > 0
    assert report.max_logprob_error < 1e-3


def test_stablelm_on_torch_paged(tmp_path: Path) -> None:
    config = StableLmConfig(
        **CONFIG, num_key_value_heads=2, use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True
    )
    check_parity(
        build_tiny_model(config, seed=2),
        tmp_path,
        llm_kwargs={"attention_backend": "torch_paged", "model_impl": "pagoda"},
    )
