"""A checkpoint's fp8 KV cache scales: routed out of the weight stream into the attention layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.attention.layer import Attention
from pagoda.model_loader.kv_scales import CheckpointKVScales


class _SelfAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k_proj = nn.Linear(4, 4)
        self.attn = Attention(num_heads=2, head_dim=2, scale=1.0, num_kv_heads=2)


class _Model(nn.Module):
    """The Llama family's layout: model.layers.N.self_attn.attn is the Attention."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module() for _ in range(layers)])
        for layer in self.model.layers:
            layer.self_attn = _SelfAttn()

    def attn(self, i: int) -> Attention:
        return self.model.layers[i].self_attn.attn


def _scales(model: _Model, i: int) -> tuple[float, float, bool]:
    a = model.attn(i)
    return a._k_scale_float, a._v_scale_float, a.kv_scales_from_checkpoint


def test_every_naming_reaches_its_layer_and_the_rest_passes_through() -> None:
    model = _Model()
    weight = torch.ones(4, 4)
    stream = [
        ("model.layers.0.self_attn.k_proj.weight", weight),
        ("model.layers.0.self_attn.k_scale", torch.tensor([0.25])),  # compressed-tensors
        ("model.layers.0.self_attn.v_scale", torch.tensor(0.5)),
        ("model.layers.1.self_attn.k_proj.output_scale", torch.tensor([0.125])),  # AutoFP8: k only
        ("model.layers.2.self_attn.attn.k_scale", torch.tensor([2.0])),  # vLLM's own naming
        ("model.layers.2.self_attn.attn.v_scale", torch.tensor([3.0])),
        ("model.layers.3.self_attn.kv_scale", torch.tensor([0.75])),  # one for both
        ("model.layers.9.self_attn.k_scale", torch.tensor([1.5])),  # no such layer here: the family decides
    ]
    routed = CheckpointKVScales(model)
    passed = list(routed.take(stream))
    assert [n for n, _ in passed] == ["model.layers.0.self_attn.k_proj.weight", "model.layers.9.self_attn.k_scale"]
    assert _scales(model, 0) == (0.25, 0.5, True)
    assert _scales(model, 1) == (0.125, 0.125, True)  # a lone scale serves both, as vLLM duplicates it
    assert _scales(model, 2) == (2.0, 3.0, True)
    assert _scales(model, 3) == (0.75, 0.75, True)
    assert len(routed.loaded) == 4


def test_the_bound_cache_decides_whether_scales_are_used() -> None:
    """An fp8 cache reads the checkpoint's scales (as 0-d tensors the backend gets); any other cache none."""
    model = _Model(1)
    list(CheckpointKVScales(model).take([("model.layers.0.self_attn.k_scale", torch.tensor([0.25])),
                                         ("model.layers.0.self_attn.v_scale", torch.tensor([0.5]))]))
    attn = model.attn(0)
    attn.bind(backend=None, kv_cache=torch.zeros(1, dtype=torch.bfloat16))  # type: ignore[arg-type]
    assert attn._k_scale is None and attn._v_scale is None  # kv_cache_dtype auto: ignored, as vLLM does
    attn.bind(backend=None, kv_cache=torch.zeros(1, dtype=torch.float8_e4m3fn))  # type: ignore[arg-type]
    assert float(attn._k_scale) == 0.25 and float(attn._v_scale) == 0.5
    # a scale loaded after binding reaches the tensor a captured graph reads
    attn.load_kv_scale("k", 0.125)
    assert float(attn._k_scale) == 0.125


@pytest.mark.parametrize("name,tensor,message", [
    ("model.layers.0.self_attn.k_scale", torch.tensor([0.1, 0.2]), "per-tensor"),
    ("model.layers.0.self_attn.v_scale", torch.tensor([0.0]), "finite and positive"),
    ("model.layers.0.self_attn.k_scale", torch.tensor([float("nan")]), "finite and positive"),
    ("model.layers.0.self_attn.q_scale", torch.tensor([0.1]), "query"),
    ("model.layers.0.self_attn.prob_scale", torch.tensor([0.1]), "query"),
])
def test_bad_scales_are_refused_by_name(name: str, tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        list(CheckpointKVScales(_Model(1)).take([(name, tensor)]))
    assert name in str(err.value)


def test_two_different_values_for_one_scale_are_refused() -> None:
    stream = [("model.layers.0.self_attn.k_scale", torch.tensor([0.25])),
              ("model.layers.0.self_attn.k_proj.output_scale", torch.tensor([0.5]))]
    with pytest.raises(ValueError, match="two k_scale values"):
        list(CheckpointKVScales(_Model(1)).take(stream))


def test_a_parent_with_two_attention_layers_names_neither() -> None:
    model = nn.Module()
    model.block = nn.Module()
    model.block.self_attn = Attention(num_heads=1, head_dim=2, scale=1.0)
    model.block.cross_attn = Attention(num_heads=1, head_dim=2, scale=1.0)
    routed = CheckpointKVScales(model)
    assert [n for n, _ in routed.take([("block.k_scale", torch.tensor([0.5]))])] == ["block.k_scale"]
    list(routed.take([("block.self_attn.k_scale", torch.tensor([0.5]))]))
    assert model.block.self_attn._k_scale_float == 0.5 and not model.block.cross_attn.kv_scales_from_checkpoint


def test_layers_kept_apart_from_the_checkpoint_modules_are_found_by_index() -> None:
    """The transformers fallback's layout: the Attention layers in one list, the checkpoint's modules elsewhere."""
    model = nn.Module()
    model.attn_layers = nn.ModuleList([Attention(num_heads=1, head_dim=2, scale=1.0, layer_idx=i) for i in range(3)])
    stream = [("model.layers.1.self_attn.k_scale", torch.tensor([0.5])),
              ("model.layers.1.self_attn.v_scale", torch.tensor([0.25])),
              ("model.layers.7.self_attn.k_scale", torch.tensor([0.5]))]  # no layer 7: passed on
    assert [n for n, _ in CheckpointKVScales(model).take(stream)] == ["model.layers.7.self_attn.k_scale"]
    assert (model.attn_layers[1]._k_scale_float, model.attn_layers[1]._v_scale_float) == (0.5, 0.25)
    assert not model.attn_layers[0].kv_scales_from_checkpoint and not model.attn_layers[2].kv_scales_from_checkpoint
