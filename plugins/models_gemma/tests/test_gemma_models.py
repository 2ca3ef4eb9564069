"""The engine's Gemma-family models against transformers' own, on tiny random checkpoints, over a paged KV cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig

from pagoda.testing.paged_kv import PagedKVHarness
from pagoda_models_gemma import gemma
from pagoda_models_gemma.norm import GemmaRMSNorm

ATOL = 1e-4
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


class Pair:
    """A transformers reference model and the engine model loaded from its state dict."""

    def __init__(self, case: str, dtype: torch.dtype = torch.float32) -> None:
        hf_config, cls = _configs()[case]
        torch.manual_seed(0)
        self.hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
        _randomize(self.hf)
        self.hf.tie_weights()
        self.model = cls(hf_config, dtype)
        state = self.hf.state_dict()
        self.loaded = self.model.load_weights(state.items())
        self.state_names = set(state)

    def reference_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(input_ids=token_ids[None]).logits[0].float()


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest) -> Pair:
    return Pair(request.param)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def _run(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, metadata))


def test_hf_model_is_the_expected_class(pair: Pair) -> None:
    assert type(pair.hf).__name__ == type(pair.model).__name__


def test_load_weights_consumes_every_checkpoint_tensor(pair: Pair) -> None:
    expected = set(pair.state_names)
    if pair.model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert pair.loaded == expected


def test_norm_weights_hold_one_plus_the_checkpoint_weight(pair: Pair) -> None:
    hf_params = dict(pair.hf.named_parameters())
    ours = dict(pair.model.named_parameters())
    norms = [f"{p}.weight" for p, m in pair.model.named_modules() if isinstance(m, GemmaRMSNorm)]
    assert norms
    for name in norms:
        # float32: exactly transformers' 1.0 + weight.float()
        assert torch.equal(ours[name], 1.0 + hf_params[name].float()), name


def test_single_prefill_matches_transformers(pair: Pair) -> None:
    ids = _tokens(20, seed=1)
    harness = PagedKVHarness(pair.model)
    positions, metadata = harness.step([(harness.new_sequence(20), 20)])
    logits = _run(pair.model, ids, positions, metadata)
    assert logits.dtype == torch.float32 and logits.shape == (20, SMALL["vocab_size"])
    torch.testing.assert_close(logits, pair.reference_logits(ids), atol=ATOL, rtol=0)


def test_two_sequences_in_one_flat_batch(pair: Pair) -> None:
    first, second = _tokens(13, seed=2), _tokens(20, seed=3)
    harness = PagedKVHarness(pair.model)
    positions, metadata = harness.step([(harness.new_sequence(13), 13), (harness.new_sequence(20), 20)])
    logits = _run(pair.model, torch.cat([first, second]), positions, metadata)
    torch.testing.assert_close(logits[:13], pair.reference_logits(first), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[13:], pair.reference_logits(second), atol=ATOL, rtol=0)


def test_decode_steps_beside_a_chunked_prefill(pair: Pair) -> None:
    """Sequence A prefills then decodes one token a step; B prefills in chunks in the same steps."""
    a_ids, b_ids = _tokens(18, seed=4), _tokens(22, seed=5)
    a_ref, b_ref = pair.reference_logits(a_ids), pair.reference_logits(b_ids)
    harness = PagedKVHarness(pair.model)
    a, b = harness.new_sequence(18), harness.new_sequence(22)

    positions, metadata = harness.step([(a, 12)])
    torch.testing.assert_close(_run(pair.model, a_ids[:12], positions, metadata), a_ref[:12], atol=ATOL, rtol=0)

    b_chunks = [5, 5, 5, 4, 3]
    b_done = 0
    for step, chunk in enumerate(b_chunks + [0]):
        a_pos = 12 + step
        scheduled = [(a, 1)] + ([(b, chunk)] if chunk else [])
        positions, metadata = harness.step(scheduled)
        ids = torch.cat([a_ids[a_pos : a_pos + 1], b_ids[b_done : b_done + chunk]])
        logits = _run(pair.model, ids, positions, metadata)
        torch.testing.assert_close(logits[:1], a_ref[a_pos : a_pos + 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1:], b_ref[b_done : b_done + chunk], atol=ATOL, rtol=0)
        b_done += chunk


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
    pair = Pair(case)
    cap = pair.model.options.final_logit_softcapping
    assert cap is not None
    ids = _tokens(20, seed=6)
    harness = PagedKVHarness(pair.model)
    positions, metadata = harness.step([(harness.new_sequence(20), 20)])
    logits = _run(pair.model, ids, positions, metadata)
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
    pair = Pair("gemma")
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
