"""Gemma, Gemma 2 and Gemma 3 end to end through ``pagoda.LLM`` against transformers (shared parity check).

Greedy tokens and top-5 logprobs of a mixed batch of 13 prompts (1 to 120 tokens), float32, chunked prefill
under a 32-token step budget, prefix caching on. Gemma 2 / 3 slide a 16-token window over prompts up to
120 tokens long, and Gemma 2's soft-caps are small enough to change every logit they touch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

from pagoda.testing.model_parity import build_tiny_model, check_parity

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)
WINDOW = 16


def _configs() -> dict[str, Any]:
    return {
        "gemma": GemmaConfig(**CONFIG),
        "gemma2-window16-softcap": Gemma2Config(
            **{**CONFIG, "num_hidden_layers": 3},
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=5.0,
        ),
        "gemma3-window16": Gemma3TextConfig(
            **{**CONFIG, "num_hidden_layers": 3},
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            },
            final_logit_softcapping=5.0,
        ),
    }


@pytest.mark.parametrize("case", ["gemma", "gemma2-window16-softcap", "gemma3-window16"])
def test_every_gemma_architecture(tmp_path: Path, case: str) -> None:
    report = check_parity(build_tiny_model(_configs()[case], seed=1), tmp_path)
    assert report.num_cached_tokens > 0
    assert report.max_logprob_error < 1e-3


def test_gemma2_on_torch_paged(tmp_path: Path) -> None:
    check_parity(
        build_tiny_model(_configs()["gemma2-window16-softcap"], seed=2),
        tmp_path,
        llm_kwargs={"attention_backend": "torch_paged"},
    )
