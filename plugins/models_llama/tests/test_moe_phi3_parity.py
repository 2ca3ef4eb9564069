"""Phi-3 and the MoE architectures end to end through ``pagoda.LLM`` against transformers (shared parity check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import MixtralConfig, Phi3Config, Qwen2MoeConfig, Qwen3MoeConfig

from pagoda.testing.model_parity import build_tiny_model, check_parity, save_tiny_model

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _configs() -> dict[str, Any]:
    return {
        "mixtral": MixtralConfig(**CONFIG, num_local_experts=8, num_experts_per_tok=2),
        "qwen2-moe": Qwen2MoeConfig(
            **{**CONFIG, "num_hidden_layers": 3},
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[2],
            norm_topk_prob=False,
        ),
        "qwen3-moe": Qwen3MoeConfig(
            **{**CONFIG, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
        # longrope with the original context above every prompt here: transformers then uses the short
        # factors throughout (see pagoda.layers.rope_scaling), and cos/sin carry the attention factor
        "phi3-longrope-partial": Phi3Config(
            **{**CONFIG, "max_position_embeddings": 1024},
            pad_token_id=0,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                # head_dim 16, half of it rotates: 4 frequencies
                "short_factor": [1.0, 1.3, 1.9, 2.8],
                "long_factor": [2.0, 4.0, 6.0, 9.0],
                "original_max_position_embeddings": 256,
            },
        ),
        "phi3": Phi3Config(**CONFIG, pad_token_id=0),
    }


@pytest.mark.parametrize("case", list(_configs()))
def test_parity_through_the_engine(tmp_path: Path, case: str) -> None:
    report = check_parity(build_tiny_model(_configs()[case], seed=1), tmp_path)
    assert report.num_cached_tokens > 0


def test_experts_run_on_the_platform_linear_kernel(tmp_path: Path) -> None:
    """After LLM loads a Mixtral, every expert projection holds the platform's kernel, not F.linear."""
    from pagoda import LLM
    from pagoda.layers import FusedMoE

    model_dir = save_tiny_model(build_tiny_model(_configs()["mixtral"], seed=2), tmp_path / "mixtral")
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=64)
    model = llm.llm_engine.engine_core.core.runner.model
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(blocks) == 2
    kernels = {type(lin.kernel).__name__ for block in blocks for e in block.experts for lin in (e.gate_up_proj, e.down_proj)}
    kernels |= {type(block.gate.kernel).__name__ for block in blocks}
    assert "NoneType" not in kernels, kernels
    print("expert linear kernels:", kernels)


@pytest.mark.parametrize(("case", "reason"), [("mixtral", "model MixtralForCausalLM"), ("qwen3-moe", "model Qwen3MoeForCausalLM")])
def test_moe_models_opt_out_of_decode_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str, reason: str
) -> None:
    """FusedMoE syncs with the host per step: a platform that would capture decode graphs skips them for it."""
    import logging

    from pagoda import LLM
    from pagoda.worker import graphs

    monkeypatch.setattr(graphs, "capture_sizes_for", lambda platform, config: [1, 2, 4])
    model_dir = save_tiny_model(build_tiny_model(_configs()[case], seed=3), tmp_path / case)
    with caplog.at_level(logging.INFO, logger=graphs.logger.name):
        llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert llm.llm_engine.engine_core.core.runner.graphs is None
    assert f"graphs off: {reason}" in caplog.text


def test_dense_phi3_decodes_through_cpu_kernel_graphs(tmp_path: Path) -> None:
    """A dense model is graph-safe: its decode steps replay kernel graphs (parity above runs through them)."""
    from pagoda import LLM

    model_dir = save_tiny_model(build_tiny_model(_configs()["phi3"], seed=3), tmp_path / "phi3")
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_seqs=4)
    graphs = llm.llm_engine.engine_core.core.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert graphs.num_replays > 0
