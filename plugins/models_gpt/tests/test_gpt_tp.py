"""The GPT family with tensor_parallel_size=2 (mp executor, gloo on loopback) against transformers, float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config, OPTConfig

from pagoda.testing.model_parity import build_tiny_model, check_tensor_parallel_parity, randomize_weights


def _configs() -> dict[str, Any]:
    return {
        # Conv1D weights transposed, then split; the learned position table vocab-parallel
        "gpt2": GPT2Config(vocab_size=131, n_embd=64, n_layer=2, n_head=4, n_positions=256),
        # project_in / project_out replicated around a post-norm decoder
        "opt-post-norm-project-in-out": OPTConfig(
            vocab_size=131, hidden_size=64, ffn_dim=96, num_attention_heads=4, num_hidden_layers=2,
            max_position_embeddings=256, do_layer_norm_before=False, word_embed_proj_dim=32),
        # one KV head replicated on both ranks; each rank's ALiBi slopes are its heads'
        "falcon-alibi-multi-query": FalconConfig(vocab_size=131, hidden_size=64, num_attention_heads=4,
                                                 num_hidden_layers=2, max_position_embeddings=256, alibi=True),
    }


def _reference(hf_config: Any) -> Any:
    """``build_tiny_model``, but SDPA for Falcon with ALiBi: the path whose slopes pagoda follows
    (see ``falcon_alibi_slopes`` and test_gpt_parity.py)."""
    if not getattr(hf_config, "alibi", False):
        return build_tiny_model(hf_config, seed=3)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").float().eval()
    randomize_weights(model, seed=3)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    return model


@pytest.mark.parametrize("case", list(_configs()))
def test_gpt_family_tp2_greedy_equals_transformers(tmp_path: Path, case: str) -> None:
    check_tensor_parallel_parity(_reference(_configs()[case]), tmp_path, llm_kwargs={"model_impl": "pagoda"})
