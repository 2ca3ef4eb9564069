"""The engine's GPT-2, OPT and Falcon models against transformers' own, on tiny random checkpoints.

Each case runs over a real paged KV cache (``PagedKVHarness``): one prefill, two sequences in one flat batch,
and decode steps beside a chunked prefill, all compared with transformers' forward.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config, OPTConfig

from pagoda.attention import Attention
from pagoda.layers import get_alibi_slopes
from pagoda.testing import family_checks as fc
from pagoda.testing.model_parity import randomize_weights
from pagoda_models_gpt import gpt
from pagoda_models_gpt.arch import falcon_alibi_slopes

VOCAB = 256
GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
OPT = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_attention_heads=4, num_hidden_layers=2,
           max_position_embeddings=128)
FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=128)


def _configs() -> dict[str, tuple[Any, type]]:
    return {
        "gpt2": (GPT2Config(**GPT2), gpt.GPT2LMHeadModel),
        "gpt2-untied-gelu-inverse-layer-scale": (
            GPT2Config(**GPT2, tie_word_embeddings=False, activation_function="gelu",
                       scale_attn_by_inverse_layer_idx=True, n_inner=96),
            gpt.GPT2LMHeadModel,
        ),
        "gpt2-unscaled": (GPT2Config(**GPT2, scale_attn_weights=False), gpt.GPT2LMHeadModel),
        "opt": (OPTConfig(**OPT), gpt.OPTForCausalLM),
        "opt-post-norm-project-in-out": (
            OPTConfig(**OPT, do_layer_norm_before=False, word_embed_proj_dim=32), gpt.OPTForCausalLM
        ),
        "opt-no-bias-untied-gelu": (
            OPTConfig(**OPT, enable_bias=False, tie_word_embeddings=False, activation_function="gelu"),
            gpt.OPTForCausalLM,
        ),
        "falcon-rotary-multi-query-parallel": (FalconConfig(**FALCON), gpt.FalconForCausalLM),
        "falcon-rotary-mha-sequential-bias": (
            FalconConfig(**FALCON, multi_query=False, parallel_attn=False, bias=True), gpt.FalconForCausalLM
        ),
        "falcon-new-arch-gqa": (
            FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2, bias=True), gpt.FalconForCausalLM
        ),
        "falcon-new-arch-one-norm-mqa": (
            FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=1),
            gpt.FalconForCausalLM,
        ),
        "falcon-alibi-multi-query-parallel": (FalconConfig(**FALCON, alibi=True), gpt.FalconForCausalLM),
        "falcon-alibi-mha-sequential-bias": (
            FalconConfig(**FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True),
            gpt.FalconForCausalLM,
        ),
        "falcon-alibi-new-arch-gqa-6-heads": (
            FalconConfig(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_hidden_layers=2,
                         max_position_embeddings=128, alibi=True, new_decoder_architecture=True, num_kv_heads=2),
            gpt.FalconForCausalLM,
        ),
    }


CASES = list(_configs())


def _attn_implementation(hf_config: Any) -> str:
    """Eager attention, except Falcon with ALiBi: SDPA (see test_transformers_eager_falcon_adds_alibi_twice)."""
    return "sdpa" if getattr(hf_config, "alibi", False) else "eager"


def reference_model(hf_config: Any) -> Any:
    """transformers' model for ``hf_config`` with its initial weights. A copy of the config: loading mutates it."""
    hf_config = copy.deepcopy(hf_config)
    return AutoModelForCausalLM.from_config(hf_config, attn_implementation=_attn_implementation(hf_config)).float().eval()


def _pair(case: str) -> fc.ModelPair:
    """The reference (seeded weights) built from a copy of the config, the engine model from the original."""
    hf_config, cls = _configs()[case]
    impl = _attn_implementation(hf_config)
    return fc.ModelPair(hf_config, cls, fc.reference_model(copy.deepcopy(hf_config), attn_implementation=impl))


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest) -> fc.ModelPair:
    return _pair(request.param)


class TestPagedKV(fc.PagedKVScenarios):
    """Load, prefill, two sequences in one flat batch, decode beside a chunked prefill: on every configuration."""


def test_saved_checkpoint_names_load(pair: fc.ModelPair, tmp_path: Path) -> None:
    """``save_pretrained`` writes the names transformers saves (and drops tied copies); they load too."""
    fc.check_saved_checkpoint_loads(pair, tmp_path)


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items() if k != "lm_head.weight"}


@pytest.mark.parametrize(("case", "prefix"), [("gpt2", "transformer."), ("opt", "model.")])
def test_base_model_checkpoint_names_load(case: str, prefix: str) -> None:
    """The hub's GPT-2 and OPT files are saved from the base model: 'h.0.attn.c_attn.weight', 'decoder.layers.0...'."""
    p = _pair(case)
    state = _strip(p.hf.state_dict(), prefix)
    assert not any(k.startswith(prefix) for k in state)
    model = p.cls(p.hf_config, torch.float32)
    model.load_weights(state.items())
    fc.check_prefill_matches_reference(p, p.tokens(11, seed=7), model)


def test_gpt2_conv1d_weights_are_transposed() -> None:
    """GPT-2's Conv1D weights are [in, out]; taking them as [out, in] changes the logits (the square
    c_proj fits either way, so only the logits tell)."""
    p = _pair("gpt2")
    model = gpt.GPT2LMHeadModel(p.hf_config, torch.float32)
    state = p.hf.state_dict()
    state = {k: (v.t() if k.endswith("attn.c_attn.weight") or k.endswith("mlp.c_fc.weight")
                 or k.endswith("mlp.c_proj.weight") else v) for k, v in state.items()}
    model.convert_checkpoint_tensor = lambda name, tensor: tensor  # type: ignore[method-assign]
    model.load_weights(state.items())
    fc.check_prefill_differs_from_reference(p, p.tokens(12, seed=8), model)


@pytest.mark.parametrize("case", ["falcon-rotary-mha-sequential-bias", "falcon-new-arch-gqa"])
def test_falcon_fused_qkv_rows_are_regrouped(case: str) -> None:
    """Falcon's fused rows are per head ([heads, 3, d]) or per KV group ([kv, group + 2, d]); taken as
    [q; k; v] blocks they give other logits."""
    p = _pair(case)
    model = gpt.FalconForCausalLM(p.hf_config, torch.float32)
    model.convert_checkpoint_tensor = lambda name, tensor: tensor  # type: ignore[method-assign]
    model.load_weights(p.hf.state_dict().items())
    fc.check_prefill_differs_from_reference(p, p.tokens(12, seed=9), model)


def test_opt_positions_are_offset_by_two() -> None:
    p = _pair("opt")
    model = gpt.OPTForCausalLM(p.hf_config, torch.float32)
    model.load_weights(p.hf.state_dict().items())
    model.model.position_offset = 0
    fc.check_prefill_differs_from_reference(p, p.tokens(12, seed=10), model)


def test_alibi_slopes_reach_the_attention_layers() -> None:
    p = _pair("falcon-alibi-new-arch-gqa-6-heads")
    slopes = falcon_alibi_slopes(6, 8)
    expected = get_alibi_slopes(6).to(torch.bfloat16).float() * 8**-0.5
    assert torch.equal(torch.tensor(slopes), expected)
    layers = [m for m in p.model.modules() if isinstance(m, Attention)]
    assert len(layers) == 2 and all(layer.alibi_slopes_tuple() == slopes for layer in layers)
    assert p.model.model.rotary_emb is None
    # without the bias the model is another model
    for layer in layers:
        layer.alibi_slopes = None
    fc.check_prefill_differs_from_reference(p, p.tokens(16, seed=11), p.model)


def test_transformers_eager_falcon_adds_alibi_twice() -> None:
    """Why Falcon-with-ALiBi is checked against transformers' SDPA path: in transformers 5 the eager
    path adds ALiBi to the scores and again through the causal mask it was folded into, so eager
    equals SDPA with the slopes doubled. pagoda matches the single bias (SDPA, the default, and
    Falcon's original attention)."""
    import transformers.models.falcon.modeling_falcon as falcon

    hf_config = _configs()["falcon-alibi-multi-query-parallel"][0]
    models = {}
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), attn_implementation=impl).eval()
        randomize_weights(model, seed=3)
        models[impl] = model
    ids = fc.tokens(20, seed=12, vocab_size=VOCAB)[None]
    with torch.no_grad():
        eager = models["eager"](ids).logits
        sdpa = models["sdpa"](ids).logits
        build = falcon.build_alibi_tensor
        try:
            falcon.build_alibi_tensor = lambda mask, heads, dtype: 2 * build(mask, heads, dtype)
            doubled = models["sdpa"](ids).logits
        finally:
            falcon.build_alibi_tensor = build
    assert (eager - sdpa).abs().max() > 1e-2
    torch.testing.assert_close(eager, doubled, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("case", "drop"),
    [
        ("gpt2", "transformer.h.1.attn.c_attn.bias"),
        ("opt", "model.decoder.layers.0.self_attn.k_proj.weight"),
        ("opt-post-norm-project-in-out", "model.decoder.project_in.weight"),
        ("opt", "model.decoder.final_layer_norm.weight"),
        ("falcon-new-arch-gqa", "transformer.h.1.ln_mlp.bias"),
        ("falcon-rotary-mha-sequential-bias", "transformer.h.0.post_attention_layernorm.weight"),
    ],
)
def test_a_missing_checkpoint_tensor_is_named(case: str, drop: str) -> None:
    hf_config, cls = _configs()[case]
    hf = reference_model(hf_config)
    state = {k: v for k, v in hf.state_dict().items() if k != drop}
    with pytest.raises(ValueError, match=f"missing weight.*{drop.replace('.', '[.]')}"):
        cls(hf_config, torch.float32).load_weights(state.items())


def test_an_unknown_or_misshapen_checkpoint_tensor_is_named() -> None:
    hf_config, cls = _configs()["falcon-new-arch-gqa"]
    state = reference_model(hf_config).state_dict()
    extra = {**state, "transformer.h.0.self_attention.rotary.weight": torch.ones(16)}
    with pytest.raises(ValueError, match="rotary.weight' matches no parameter"):
        cls(hf_config, torch.float32).load_weights(extra.items())
    bad = {**state, "transformer.h.0.self_attention.query_key_value.bias": torch.ones(8)}
    with pytest.raises(ValueError, match="query_key_value.bias' has shape"):
        cls(hf_config, torch.float32).load_weights(bad.items())


@pytest.mark.parametrize(
    ("config", "cls", "message"),
    [
        (GPT2Config(**GPT2, add_cross_attention=True), gpt.GPT2LMHeadModel, "add_cross_attention"),
        (OPTConfig(**OPT, layer_norm_elementwise_affine=False), gpt.OPTForCausalLM, "elementwise_affine"),
        (OPTConfig(**OPT, activation_function="tanh"), gpt.OPTForCausalLM, "activation 'tanh' is not supported"),
        (FalconConfig(**FALCON, new_decoder_architecture=True, parallel_attn=False), gpt.FalconForCausalLM,
         "parallel_attn=False"),
        (FalconConfig(**FALCON, num_ln_in_parallel_attn=2), gpt.FalconForCausalLM, "num_ln_in_parallel_attn=2"),
        (FalconConfig(**FALCON, multi_query=False, num_kv_heads=2), gpt.FalconForCausalLM, "num_kv_heads=2"),
    ],
)
def test_unsupported_options_are_refused(config: Any, cls: type, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(config, torch.float32)


def test_gpt2_reorder_and_upcast_attn() -> None:
    """In float32 the upcast is the identity (served, equal to transformers' upcast path); in a half
    type it is refused rather than silently computed another way."""
    config = GPT2Config(**GPT2, reorder_and_upcast_attn=True)
    with pytest.raises(ValueError, match="reorder_and_upcast_attn=True is supported in float32 only"):
        gpt.GPT2LMHeadModel(config, torch.bfloat16)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    randomize_weights(hf, seed=5)
    model = gpt.GPT2LMHeadModel(config, torch.float32)
    model.load_weights(hf.state_dict().items())
    ids = fc.tokens(15, seed=13, vocab_size=VOCAB)
    with torch.no_grad():
        reference = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(fc.prefill_logits(model, ids), reference, atol=fc.ATOL, rtol=0)
