"""The engine's GPT-NeoX, Phi and StableLM models against transformers' own, on tiny random checkpoints.

Each case runs over a real paged KV cache (``PagedKVHarness``): one prefill, two sequences in one flat batch,
and decode steps beside a chunked prefill, all compared with transformers' eager forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, PhiConfig, StableLmConfig

from pagoda.testing import family_checks as fc
from pagoda_models_neox import neox

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=128)


def _configs() -> dict[str, tuple[Any, type]]:
    return {
        "gpt-neox-parallel": (
            GPTNeoXConfig(**SMALL, num_hidden_layers=2, hidden_act="gelu"),
            neox.GPTNeoXForCausalLM,
        ),
        "gpt-neox-sequential-tied-nobias": (
            GPTNeoXConfig(
                **SMALL,
                num_hidden_layers=2,
                use_parallel_residual=False,
                attention_bias=False,
                tie_word_embeddings=True,
                rotary_pct=0.5,
                rotary_emb_base=500,
            ),
            neox.GPTNeoXForCausalLM,
        ),
        "phi": (PhiConfig(**SMALL, num_hidden_layers=2), neox.PhiForCausalLM),
        "phi-qk-layernorm-gqa-tied": (
            PhiConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2, qk_layernorm=True, tie_word_embeddings=True),
            neox.PhiForCausalLM,
        ),
        "stablelm": (StableLmConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=4), neox.StableLmForCausalLM),
        "stablelm-qkv-bias-qk-norm-parallel-gqa": (
            StableLmConfig(
                **SMALL,
                num_hidden_layers=2,
                num_key_value_heads=2,
                use_qkv_bias=True,
                qk_layernorm=True,
                use_parallel_residual=True,
                partial_rotary_factor=0.5,
            ),
            neox.StableLmForCausalLM,
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


def test_saved_checkpoint_names_load(pair: fc.ModelPair, tmp_path: Path) -> None:
    """``save_pretrained`` writes the hub's names (GPT-NeoX: ``embed_out``, not ``lm_head``); they load too."""
    fc.check_saved_checkpoint_loads(pair, tmp_path)


def test_gpt_neox_qkv_rows_are_interleaved_per_head() -> None:
    """Rows of query_key_value are [heads, 3, head_dim]; loading them as [q; k; v] blocks changes the logits."""
    p = _pair("gpt-neox-parallel")
    model = neox.GPTNeoXForCausalLM(p.hf_config, torch.float32)
    # skip the reordering: the checkpoint's interleaved rows taken as if they were q, k, v blocks
    model.convert_checkpoint_tensor = lambda name, tensor: tensor  # type: ignore[method-assign]
    model.load_weights(p.hf.state_dict().items())
    fc.check_prefill_differs_from_reference(p, p.tokens(12, seed=7), model)


@pytest.mark.parametrize(
    ("case", "drop"),
    [
        ("gpt-neox-parallel", "gpt_neox.layers.1.attention.query_key_value.bias"),
        ("phi", "model.layers.0.self_attn.k_proj.weight"),
        ("stablelm-qkv-bias-qk-norm-parallel-gqa", "model.layers.1.self_attn.k_layernorm.norms.1.weight"),
        ("stablelm", "model.layers.0.mlp.up_proj.weight"),
    ],
)
def test_a_missing_checkpoint_tensor_is_named(case: str, drop: str) -> None:
    hf_config, cls = _configs()[case]
    hf = AutoModelForCausalLM.from_config(hf_config)
    state = {k: v for k, v in hf.state_dict().items() if k != drop}
    with pytest.raises(ValueError, match=f"missing weight.*{drop.replace('.', '[.]')}"):
        cls(hf_config, torch.float32).load_weights(state.items())


def test_an_unknown_or_misshapen_checkpoint_tensor_is_named() -> None:
    hf_config, cls = _configs()["stablelm-qkv-bias-qk-norm-parallel-gqa"]
    state = AutoModelForCausalLM.from_config(hf_config).state_dict()
    extra = {**state, "model.layers.0.self_attn.q_layernorm.norms.9.weight": torch.ones(16)}
    with pytest.raises(ValueError, match="norms.9.weight' matches no parameter"):
        cls(hf_config, torch.float32).load_weights(extra.items())
    bad = {**state, "model.layers.0.self_attn.q_proj.bias": torch.ones(8)}
    with pytest.raises(ValueError, match="q_proj.bias' has shape"):
        cls(hf_config, torch.float32).load_weights(bad.items())


def test_an_unsupported_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="activation 'tanh' is not supported"):
        neox.GPTNeoXForCausalLM(GPTNeoXConfig(**SMALL, num_hidden_layers=1, hidden_act="tanh"), torch.float32)
    with pytest.raises(ValueError, match="does not support activation 'relu'"):
        neox.StableLmForCausalLM(
            StableLmConfig(**SMALL, num_hidden_layers=1, num_key_value_heads=4, hidden_act="relu"), torch.float32
        )
