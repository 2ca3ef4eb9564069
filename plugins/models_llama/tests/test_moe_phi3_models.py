"""Mixtral, Qwen2-MoE, Qwen3-MoE and Phi-3 against transformers' own models, on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, Phi3Config, Qwen2MoeConfig, Qwen3MoeConfig

from pagoda.layers import FusedMoE, Linear
from pagoda.testing import family_checks as fc
from pagoda_models_llama import llama

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    # rotary_dim = 16 * 0.5 = 8 channels: 4 frequencies
    "short_factor": [1.0, 1.3, 1.7, 2.2],
    "long_factor": [1.5, 2.5, 4.0, 6.0],
    "original_max_position_embeddings": 32,
}


def _configs() -> dict[str, tuple[Any, type]]:
    return {
        "mixtral": (
            MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
            llama.MixtralForCausalLM,
        ),
        "mixtral-window8": (
            MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
            llama.MixtralForCausalLM,
        ),
        # layer 1 dense (mlp_only_layers), a shared expert, top-3 weights not renormalised
        "qwen2-moe-shared-dense1": (
            Qwen2MoeConfig(
                **SMALL,
                num_hidden_layers=3,
                num_experts=6,
                num_experts_per_tok=3,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                mlp_only_layers=[1],
                norm_topk_prob=False,
            ),
            llama.Qwen2MoeForCausalLM,
        ),
        # every second layer sparse (decoder_sparse_step=2), qk-norm, renormalised top-2
        "qwen3-moe-step2": (
            Qwen3MoeConfig(
                **SMALL,
                num_hidden_layers=4,
                head_dim=32,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                decoder_sparse_step=2,
                norm_topk_prob=True,
            ),
            llama.Qwen3MoeForCausalLM,
        ),
        "phi3": (Phi3Config(**SMALL, num_hidden_layers=2, pad_token_id=0), llama.Phi3ForCausalLM),
        "phi3-longrope-partial": (
            Phi3Config(
                **SMALL,
                num_hidden_layers=2,
                pad_token_id=0,
                original_max_position_embeddings=32,
                rope_parameters=LONGROPE,
            ),
            llama.Phi3ForCausalLM,
        ),
    }


CASES = list(_configs())


def _pair(case: str) -> fc.ModelPair:
    return fc.ModelPair(*_configs()[case])


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest) -> fc.ModelPair:
    return _pair(request.param)


class TestPagedKV(fc.PagedKVScenarios):
    """Every configuration: transformers 5's state_dict (MoE experts as 3-D tensors) loads whole; prefill, a
    flat batch of two sequences (each token routed on its own) and decode beside a chunked prefill match."""


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe-shared-dense1", "phi3"])
def test_hub_checkpoint_layout_loads(case: str, tmp_path: Path) -> None:
    """save_pretrained writes the hub names (Mixtral: block_sparse_moe.experts.N.w1/w2/w3; Qwen: experts.N.gate_proj)."""
    reference = _pair(case)
    reference.hf.save_pretrained(tmp_path, safe_serialization=True)
    saved = load_file(str(tmp_path / "model.safetensors"))
    if case == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in saved
    elif case.startswith("qwen2-moe"):
        assert "model.layers.0.mlp.experts.5.up_proj.weight" in saved
    model = reference.cls(reference.hf_config, torch.float32)
    assert model.load_weights(saved.items()) == set(saved)
    fc.check_prefill_matches_reference(reference, reference.tokens(15, seed=8), model)


def test_sparse_and_dense_layers_follow_the_config() -> None:
    configs = _configs()
    qwen2 = llama.Qwen2MoeForCausalLM(configs["qwen2-moe-shared-dense1"][0], torch.float32)
    kinds = [type(layer.mlp).__name__ for layer in qwen2.model.layers]
    assert kinds == ["FusedMoE", "LlamaMLP", "FusedMoE"]
    moe = qwen2.model.layers[0].mlp
    assert isinstance(moe, FusedMoE) and moe.shared_expert is not None and not moe.renormalize and moe.top_k == 3
    assert moe.experts[0].gate_up_proj.weight.shape == (64, 64)  # 2 x moe_intermediate_size rows
    assert moe.shared_expert.gate_up_proj.weight.shape == (96, 64)
    assert qwen2.model.layers[1].mlp.gate_up_proj.weight.shape == (192, 64)  # dense: 2 x intermediate_size
    qwen3 = llama.Qwen3MoeForCausalLM(configs["qwen3-moe-step2"][0], torch.float32)
    assert [type(layer.mlp).__name__ for layer in qwen3.model.layers] == ["LlamaMLP", "FusedMoE"] * 2
    assert qwen3.model.layers[1].mlp.renormalize and qwen3.model.layers[1].mlp.shared_expert is None
    mixtral = llama.MixtralForCausalLM(configs["mixtral-window8"][0], torch.float32)
    assert all(isinstance(layer.mlp, FusedMoE) and layer.mlp.renormalize for layer in mixtral.model.layers)
    assert mixtral.options.sliding_windows == (8, 8)


def test_missing_expert_weight_is_named(tmp_path: Path) -> None:
    reference = _pair("mixtral")
    reference.hf.save_pretrained(tmp_path, safe_serialization=True)
    saved = load_file(str(tmp_path / "model.safetensors"))
    del saved["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    model = llama.MixtralForCausalLM(reference.hf_config, torch.float32)
    with pytest.raises(ValueError, match=r"missing weight.*model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        model.load_weights(saved.items())
    too_many = {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(5, 192, 64)}
    with pytest.raises(ValueError, match="experts.gate_up_proj.*matches no parameter"):
        model.load_weights(too_many.items())


def test_phi3_missing_fused_weight_is_named() -> None:
    reference = _pair("phi3")
    state = {n: t for n, t in reference.hf.state_dict().items() if n != "model.layers.1.self_attn.qkv_proj.weight"}
    with pytest.raises(ValueError, match=r"missing weight.*model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        llama.Phi3ForCausalLM(reference.hf_config, torch.float32).load_weights(state.items())


def test_longrope_table_matches_transformers_on_both_sides_of_the_original_length() -> None:
    """Short factors below original_max_position_embeddings, long ones from there on, attention factor on both."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_config = _configs()["phi3-longrope-partial"][0]
    model = llama.Phi3ForCausalLM(hf_config, torch.float32)
    rotary = model.model.rotary_emb
    assert rotary.max_positions == 128 and rotary.rotary_dim == 8
    positions = torch.arange(128)
    cos, sin = rotary.cos_sin(positions)
    x = torch.zeros(1, dtype=torch.float32)
    # transformers picks one factor set per forward from its longest position
    hf_short_cos, hf_short_sin = Phi3RotaryEmbedding(hf_config)(x, positions[None, :32])
    hf_long_cos, hf_long_sin = Phi3RotaryEmbedding(hf_config)(x, positions[None, :])
    torch.testing.assert_close(cos[:32, 0], hf_short_cos[0, :, :4], atol=0, rtol=0)
    torch.testing.assert_close(sin[:32, 0], hf_short_sin[0, :, :4], atol=0, rtol=0)
    torch.testing.assert_close(cos[32:, 0], hf_long_cos[0, 32:, :4], atol=0, rtol=0)
    torch.testing.assert_close(sin[32:, 0], hf_long_sin[0, 32:, :4], atol=0, rtol=0)
    # the attention factor (factor 4 from 128 / 32) scales cos and sin: not plain RoPE
    assert cos[0, 0, 0] > 1.0


def test_moe_experts_take_the_platform_linear_kernel() -> None:
    """Experts are plain Linears: prepare_linear_layers hands every one of them to the kernel."""
    from pagoda.layers import prepare_linear_layers

    class Recording:
        name = "recording"

        def supports(self, weight: torch.Tensor) -> bool:
            return True

        def prepare(self, weight: torch.Tensor) -> torch.Tensor:
            return weight.clone()

        def apply(self, x: torch.Tensor, prepared: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return torch.nn.functional.linear(x, prepared, bias)

    pair = _pair("qwen2-moe-shared-dense1")
    linears = [m for m in pair.model.modules() if isinstance(m, Linear)]
    assert prepare_linear_layers(pair.model, Recording()) == len(linears)
    moe = pair.model.model.layers[0].mlp
    assert all(expert.gate_up_proj.kernel is not None for expert in moe.experts)
    fc.check_prefill_matches_reference(pair, pair.tokens(12, seed=9))


def test_bfloat16_moe_close_to_float32_reference() -> None:
    fp32 = _pair("mixtral")
    model = llama.MixtralForCausalLM(fp32.hf_config, torch.bfloat16)
    model.load_weights(fp32.hf.state_dict().items())
    ids = fp32.tokens(12, seed=7)
    logits = fc.prefill_logits(model, ids)
    reference = fp32.reference_logits(ids)
    assert logits.dtype == torch.bfloat16
    # bf16 may route a token to another expert at a near-tie: compare most rows, not all
    close = ((logits.float() - reference).abs().max(dim=-1).values < 0.05 * reference.abs().max()).float().mean()
    assert close >= 0.75


def test_plugin_registers_the_new_architectures() -> None:
    from pagoda.models.registry import ModelRegistry
    from pagoda.plugins import import_object

    for arch in ("Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        assert import_object(ModelRegistry.spec_for([arch]).cls) is getattr(llama, arch)
