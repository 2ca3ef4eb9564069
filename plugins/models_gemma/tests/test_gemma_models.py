"""The engine's Gemma-family models against transformers' own, on tiny random checkpoints, over a paged KV cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

from pagoda.testing import family_checks as fc
from pagoda.testing.paged_kv import PagedKVHarness
from pagoda_models_gemma import gemma
from pagoda_models_gemma.norm import GemmaRMSNorm

# head_dim 32 is not hidden_size / num_attention_heads (16): Gemma sets it independently.
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
# Small enough that the caps change the result: logits of these models reach |10| and more.
SOFTCAPS = dict(attn_logit_softcapping=4.0, final_logit_softcapping=3.0)


def _configs() -> dict[str, tuple[Any, type]]:
    return {
        "gemma": (GemmaConfig(**SMALL, num_hidden_layers=2), gemma.GemmaForCausalLM),
        "gemma-bias-untied": (
            GemmaConfig(**SMALL, num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False),
            gemma.GemmaForCausalLM,
        ),
        "gemma2-window8-softcap": (
            Gemma2Config(**SMALL, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24, **SOFTCAPS),
            gemma.Gemma2ForCausalLM,
        ),
        "gemma3-window8-local-global-rope": (
            Gemma3TextConfig(
                **SMALL,
                num_hidden_layers=3,
                sliding_window=8,
                query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                },
                final_logit_softcapping=3.0,
            ),
            gemma.Gemma3ForCausalLM,
        ),
    }


CASES = list(_configs())


def _randomize(model: torch.nn.Module) -> None:
    """Unit-scale weights and non-trivial norm weights, so a misplaced norm or a missing +1 shows in the logits."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(0.3 * noise)  # Gemma scales by 1 + weight
            elif param.ndim == 2:
                param.copy_(2.0 * noise / param.shape[1] ** 0.5)
            else:
                param.copy_(0.3 * noise)


def _pair(case: str) -> fc.ModelPair:
    hf_config, cls = _configs()[case]
    return fc.ModelPair(hf_config, cls, fc.reference_model(hf_config, randomize=_randomize))


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest) -> fc.ModelPair:
    return _pair(request.param)


def test_hf_model_is_the_expected_class(pair: fc.ModelPair) -> None:
    assert type(pair.hf).__name__ == type(pair.model).__name__


def test_norm_weights_hold_one_plus_the_checkpoint_weight(pair: fc.ModelPair) -> None:
    hf_params = dict(pair.hf.named_parameters())
    ours = dict(pair.model.named_parameters())
    norms = [f"{p}.weight" for p, m in pair.model.named_modules() if isinstance(m, GemmaRMSNorm)]
    assert norms
    for name in norms:
        # float32: exactly transformers' 1.0 + weight.float()
        assert torch.equal(ours[name], 1.0 + hf_params[name].float()), name


class TestPagedKV(fc.PagedKVScenarios):
    """Load, prefill, two sequences in one flat batch, decode beside a chunked prefill: on every configuration."""


def test_softcaps_and_windows_reach_the_layers() -> None:
    model = gemma.Gemma2ForCausalLM(_configs()["gemma2-window8-softcap"][0], torch.float32)
    attns = [layer.self_attn.attn for layer in model.model.layers]
    # transformers' Gemma 2 default: even layers (0, 2) slide, odd ones attend to everything
    assert [a.sliding_window for a in attns] == [8, None, 8]
    assert {a.logits_soft_cap for a in attns} == {4.0}
    assert {a.scale for a in attns} == {24**-0.5}


SOFTCAPPED_CASES = [case for case, (config, _) in _configs().items() if getattr(config, "final_logit_softcapping", None)]


@pytest.mark.parametrize("case", SOFTCAPPED_CASES)
def test_final_softcap_bounds_the_logits(case: str) -> None:
    pair = _pair(case)
    cap = pair.model.options.final_logit_softcapping
    assert cap is not None
    ids = pair.tokens(20, seed=6)
    logits = fc.prefill_logits(pair.model, ids)
    assert logits.abs().max() < cap
    # the cap matters here: uncapped logits go well beyond it
    with torch.inference_mode():
        harness = PagedKVHarness(pair.model)
        positions, metadata = harness.step([(harness.new_sequence(20), 20)])
        raw = pair.model.lm_head(pair.model(ids, positions, metadata))
    assert raw.abs().max() > 2 * cap


def test_bfloat16_norm_rounds_within_two_ulps_of_transformers() -> None:
    """The folded (1 + weight) in bfloat16: documented in weights.py, measured here."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    torch.manual_seed(0)
    hf_norm = HFGemmaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf_norm.weight.copy_(0.3 * torch.randn(64))
    hf_norm = hf_norm.to(torch.bfloat16)
    model = gemma.GemmaForCausalLM(GemmaConfig(**SMALL, num_hidden_layers=1), torch.bfloat16)
    ours = model.model.norm
    with torch.no_grad():
        ours.weight.copy_(hf_norm.weight.float() + 1.0)
    x = torch.randn(512, 64).to(torch.bfloat16)
    expected, got = hf_norm(x).float(), ours(x).float()
    ulp = torch.finfo(torch.bfloat16).eps * expected.abs().clamp_min(1e-3)
    assert ((got - expected).abs() <= 2 * ulp).all()


def test_unknown_and_missing_weights_are_refused() -> None:
    pair = _pair("gemma")
    state = pair.hf.state_dict()
    model = gemma.GemmaForCausalLM(_configs()["gemma"][0], torch.float32)
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([*state.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(2))])
    partial = [(k, v) for k, v in state.items() if not k.endswith("self_attn.k_proj.weight")]
    with pytest.raises(ValueError, match=r"missing weight\(s\) model.layers.0.self_attn.k_proj.weight"):
        model.load_weights(partial)


def test_gemma3_attention_softcap_is_not_applied_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # transformers' Gemma3 attention never passes the cap on; following it keeps a checkpoint's outputs.
    cfg = Gemma3TextConfig(**SMALL, num_hidden_layers=2, **SOFTCAPS)
    with caplog.at_level("WARNING"):
        model = gemma.Gemma3ForCausalLM(cfg, torch.float32)
    assert "attn_logit_softcapping=4.0 is not applied" in caplog.text
    assert {layer.self_attn.attn.logits_soft_cap for layer in model.model.layers} == {None}


def test_bidirectional_gemma3_is_refused() -> None:
    cfg = Gemma3TextConfig(**SMALL, num_hidden_layers=2, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        gemma.Gemma3ForCausalLM(cfg, torch.float32)
