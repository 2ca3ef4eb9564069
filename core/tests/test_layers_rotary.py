"""RoPE cos/sin of each scaling type against transformers' rotary embedding on the same config."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagoda.layers import TorchLayerOps
from pagoda.layers.rope_scaling import RopeConfig, inv_freq_and_attention_factor, rope_config_from_hf
from pagoda.layers.rotary import RotaryEmbedding

HEAD_DIM = 32
MAX_POS = 64

ROPE_PARAMETERS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-attention-factor-untruncated": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "attention_factor": 1.3,
        "truncate": False,
    },
}


def _config(rope_parameters: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32,
        hidden_size=4 * HEAD_DIM,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(rope_parameters),
    )


@pytest.mark.parametrize("case", list(ROPE_PARAMETERS))
def test_cos_sin_match_transformers(case: str) -> None:
    config = _config(ROPE_PARAMETERS[case])
    ours = RotaryEmbedding(rope_config_from_hf(config), torch.float32)
    # Every position the table covers; for dynamic NTK this also makes transformers rescale at
    # seq_len = max_position_embeddings * factor, the length the engine fixes its base at.
    positions = torch.arange(ours.max_positions)
    theirs = LlamaRotaryEmbedding(config)
    ref_cos, ref_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours.cos_sin(positions)
    half = HEAD_DIM // 2
    # transformers repeats the half-size table twice along the head (rotate-half layout).
    torch.testing.assert_close(cos[:, 0], ref_cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], ref_sin[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(ref_cos[0, :, half:], ref_cos[0, :, :half])


def test_table_lengths_cover_the_scaled_context() -> None:
    lengths = {case: rope_config_from_hf(_config(p)).max_positions for case, p in ROPE_PARAMETERS.items()}
    assert lengths["default"] == MAX_POS
    assert lengths["linear"] == 2 * MAX_POS
    assert lengths["dynamic"] == 3 * MAX_POS
    assert lengths["llama3"] == MAX_POS  # llama3 configs already state the extended length
    assert lengths["yarn"] == MAX_POS  # original 16 * factor 4


def test_legacy_rope_scaling_and_rope_theta_attributes() -> None:
    """transformers < 5 configs: settings in ``rope_scaling`` (key ``type``) and a top-level ``rope_theta``."""
    legacy = SimpleNamespace(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=None,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    modern = rope_config_from_hf(_config(ROPE_PARAMETERS["linear"]))
    parsed = rope_config_from_hf(legacy)
    assert parsed.rope_type == "linear" and parsed.theta == 10000.0 and parsed.rotary_dim == HEAD_DIM
    torch.testing.assert_close(inv_freq_and_attention_factor(parsed)[0], inv_freq_and_attention_factor(modern)[0])


def test_rotation_is_the_rotate_half_formula() -> None:
    cfg = RopeConfig("default", 10000.0, 8, 8, 16)
    rope = RotaryEmbedding(cfg, torch.float32)
    positions = torch.tensor([0, 3, 15])
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    cos, sin = rope.cos_sin(positions)
    expected = x * torch.cat([cos, cos], -1) + torch.cat([-x[..., 4:], x[..., :4]], -1) * torch.cat([sin, sin], -1)
    rotated = x.clone()
    TorchLayerOps().rotary_neox_(rotated, cos, sin)
    torch.testing.assert_close(rotated, expected)
    torch.testing.assert_close(rotated[0], x[0])  # position 0 is the identity


@pytest.mark.parametrize(
    ("rope_parameters", "message"),
    [
        ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
        ({"rope_type": "linear", "rope_theta": 1e4}, "factor"),
    ],
)
def test_unsupported_or_incomplete_rope_settings_are_named(rope_parameters: dict[str, Any], message: str) -> None:
    config = SimpleNamespace(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters=rope_parameters,
    )
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(rope_config_from_hf(config), torch.float32).cos_sin(torch.arange(4))
