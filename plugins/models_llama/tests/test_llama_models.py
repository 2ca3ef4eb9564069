"""The engine's Llama-family models against transformers' own, on tiny random checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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


def _configs() -> dict[str, tuple[Any, type]]:
    return {
        "llama": (LlamaConfig(**SMALL, num_hidden_layers=2), llama.LlamaForCausalLM),
        "llama-tied-bias-yarn": (
            LlamaConfig(
                **{**SMALL, "max_position_embeddings": 64},
                num_hidden_layers=2,
                tie_word_embeddings=True,
                attention_bias=True,
                mlp_bias=True,
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 10000.0,
                    "original_max_position_embeddings": 16,
                },
            ),
            llama.LlamaForCausalLM,
        ),
        "mistral-window8": (MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=8), llama.MistralForCausalLM),
        "qwen2-window8-from-layer1": (
            Qwen2Config(**SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1),
            llama.Qwen2ForCausalLM,
        ),
        "qwen3-tied": (
            Qwen3Config(**SMALL, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True),
            llama.Qwen3ForCausalLM,
        ),
    }


CASES = list(_configs())


def _pair(case: str) -> fc.ModelPair:
    return fc.ModelPair(*_configs()[case])


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest) -> fc.ModelPair:
    return _pair(request.param)


class TestPagedKV(fc.PagedKVScenarios):
    """Load, prefill, two sequences in one flat batch, decode beside a chunked prefill: on every configuration."""


def test_built_on_meta_device_then_materialized() -> None:
    """The runner may build on the meta device; the RoPE table must not be lost on materialisation."""
    reference = _pair("qwen3-tied")
    hf_config, cls = _configs()["qwen3-tied"]
    with torch.device("meta"):
        model = cls(hf_config, torch.float32)
    model.to_empty(device="cpu")
    model.load_weights(reference.hf.state_dict().items())
    fc.check_prefill_matches_reference(reference, reference.tokens(10, seed=6), model)


def test_bfloat16_parameters_and_logits() -> None:
    fp32 = _pair("llama")
    hf_config, cls = _configs()["llama"]
    model = cls(hf_config, torch.bfloat16)
    model.load_weights(fp32.hf.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = fp32.tokens(12, seed=7)
    logits = fc.prefill_logits(model, ids)
    reference = fp32.reference_logits(ids)
    # In the model dtype: the sampler widens them only when it needs to.
    assert logits.dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits: close to the fp32 reference, not equal to it.
    assert (logits.float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_sliding_windows_per_layer() -> None:
    configs = _configs()
    assert llama.Qwen2ForCausalLM(configs["qwen2-window8-from-layer1"][0], torch.float32).options.sliding_windows == (
        None,
        8,
        8,
    )
    assert llama.MistralForCausalLM(configs["mistral-window8"][0], torch.float32).options.sliding_windows == (8, 8)
    assert llama.LlamaForCausalLM(configs["llama"][0], torch.float32).options.sliding_windows == (None, None)
    no_window = Qwen2Config(**SMALL, num_hidden_layers=2, use_sliding_window=False, sliding_window=8)
    assert llama.Qwen2ForCausalLM(no_window, torch.float32).options.sliding_windows == (None, None)
    layers = [
        m.self_attn.attn.sliding_window
        for m in llama.Qwen2ForCausalLM(configs["qwen2-window8-from-layer1"][0], torch.float32).model.layers
    ]
    assert layers == [None, 8, 8]


def test_load_weights_rejects_unknown_names_and_wrong_shapes() -> None:
    hf_config, cls = _configs()["llama"]
    model = cls(hf_config, torch.float32)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        model.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(4))])
    with pytest.raises(ValueError, match="k_proj.*shape"):
        model.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(3, 64))])
    full = {n: t for n, t in _hf_state_dict(hf_config) if not n.endswith("inv_freq")}
    with pytest.raises(ValueError, match="missing weight.*model.layers.0.self_attn.v_proj.weight"):
        model.load_weights([(n, t) for n, t in full.items() if n != "model.layers.0.self_attn.v_proj.weight"])
    loaded = model.load_weights([*full.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])
    assert loaded == set(full)


def _hf_state_dict(hf_config):
    from transformers import LlamaForCausalLM as HFLlama

    return list(HFLlama(hf_config).state_dict().items())


def test_unsupported_activation_is_named() -> None:
    config = LlamaConfig(**SMALL, num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        llama.LlamaForCausalLM(config, torch.float32)


def test_plugin_registers_each_architecture_with_its_class() -> None:
    from pagoda.models.interface import CausalLMModel
    from pagoda.models.registry import ModelRegistry
    from pagoda.plugins import import_object

    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cls = import_object(ModelRegistry.spec_for([arch]).cls)
        assert cls is getattr(llama, arch)
    assert isinstance(llama.LlamaForCausalLM(_configs()["llama"][0], torch.float32), CausalLMModel)


def test_the_shared_checks_fail_on_a_wrong_model() -> None:
    """pagoda.testing.family_checks catches a model off transformers': a final norm 5% off, a tensor not loaded."""
    wrong = _pair("llama")
    with torch.no_grad():
        wrong.model.model.norm.weight.mul_(1.05)
    for check in (fc.check_single_prefill, fc.check_two_sequences_in_one_flat_batch, fc.check_decode_beside_chunked_prefill):
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            check(wrong)
    wrong.loaded.discard("model.norm.weight")
    with pytest.raises(AssertionError):
        fc.check_loads_every_checkpoint_tensor(wrong)


@pytest.mark.parametrize("case", ["llama", "qwen2-window8-from-layer1"])
def test_output_rows_returns_those_rows_of_the_full_forward(case: str) -> None:
    """forward(output_rows=...) skips the last layer's other rows past its attention (pagoda.testing's check)."""
    fc.check_output_rows(_pair(case))


def test_output_rows_refused_on_a_stage_without_the_last_layer() -> None:
    pair = _pair("llama")
    pair.model.model.is_last_stage = False
    with pytest.raises(ValueError, match="last pipeline stage"):
        pair.model(torch.tensor([1, 2]), torch.tensor([0, 1]), None, output_rows=torch.tensor([1]))
