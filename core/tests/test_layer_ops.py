"""LayerOps: the torch reference math, the modules that call it, and binding a platform's ops."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import (
    TORCH_LAYER_OPS,
    LayerOps,
    LayerOpsModule,
    RMSNorm,
    SiluAndMul,
    TorchLayerOps,
    bind_layer_ops,
)
from pagoda.platforms import Platform

EPS = 1e-6


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_torch_rms_norm_float32_is_torchs_fused_rms_norm() -> None:
    x, w = _randn(5, 32), _randn(32, seed=1)
    torch.testing.assert_close(TorchLayerOps().rms_norm(x, w, EPS), F.rms_norm(x, (32,), w, EPS), rtol=0, atol=0)


def test_torch_rms_norm_bfloat16_rounds_before_the_weight() -> None:
    """transformers' order: normalise in float32, round to bf16, multiply by the bf16 weight."""
    x, w = _randn(5, 32, dtype=torch.bfloat16), _randn(32, dtype=torch.bfloat16, seed=1)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    out = TorchLayerOps().rms_norm(x, w, EPS)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_torch_add_rms_norm_sums_then_norms_and_takes_x_without_residual() -> None:
    ops = TorchLayerOps()
    x, r, w = _randn(3, 16), _randn(3, 16, seed=1), _randn(16, seed=2)
    normed, summed = ops.add_rms_norm(x, r, w, EPS)
    torch.testing.assert_close(summed, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, ops.rms_norm(x + r, w, EPS), rtol=0, atol=0)
    normed, summed = ops.add_rms_norm(x, None, w, EPS)
    assert summed is x
    torch.testing.assert_close(normed, ops.rms_norm(x, w, EPS), rtol=0, atol=0)


def test_torch_silu_and_mul_takes_gate_then_up() -> None:
    gate_up = _randn(4, 2 * 24)
    out = TorchLayerOps().silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate_up[:, :24]) * gate_up[:, 24:], rtol=0, atol=0)


@pytest.mark.parametrize("rot", [16, 8])
def test_torch_rotary_rotates_half_in_place_on_a_strided_view(rot: int) -> None:
    """Channel i pairs with i + rot/2; channels past ``rot`` (partial rotary) stay as they were."""
    t, heads, head_dim = 3, 2, 16
    fused = _randn(t, heads * head_dim + 5)  # q/k heads inside a wider fused projection row
    qk = fused[:, : heads * head_dim].view(t, heads, head_dim)
    before = fused.clone()
    angles = _randn(t, 1, rot // 2, seed=1)
    cos, sin = angles.cos(), angles.sin()
    TorchLayerOps().rotary_neox_(qk, cos, sin)
    x = before[:, : heads * head_dim].view(t, heads, head_dim)
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    torch.testing.assert_close(qk[..., : rot // 2], x1 * cos - x2 * sin)
    torch.testing.assert_close(qk[..., rot // 2 : rot], x2 * cos + x1 * sin)
    torch.testing.assert_close(qk[..., rot:], x[..., rot:], rtol=0, atol=0)
    torch.testing.assert_close(fused[:, heads * head_dim :], before[:, heads * head_dim :], rtol=0, atol=0)


def test_torch_layer_ops_satisfy_the_protocol() -> None:
    assert isinstance(TORCH_LAYER_OPS, LayerOps)
    assert TORCH_LAYER_OPS.name == "torch"


class RecordingOps(TorchLayerOps):
    """Torch math, plus a log of which op ran."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls.append("rms_norm")
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> Any:
        self.calls.append("add_rms_norm")
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.calls.append("silu_and_mul")
        return super().silu_and_mul(gate_up)

    def rotary_neox_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.calls.append("rotary_neox_")
        super().rotary_neox_(qk, cos, sin)


class RotaryUser(LayerOpsModule):
    """Stands in for a model's attention layer, which rotates q/k through ``self.ops``."""

    def forward(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.ops.rotary_neox_(qk, cos, sin)
        return qk


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8, EPS, torch.float32)
        self.act = SiluAndMul()
        self.attn = RotaryUser()
        self.plain = nn.Identity()
        self.norm.weight.data.fill_(1.0)


def test_modules_start_on_torch_ops_and_bind_replaces_them_everywhere() -> None:
    model = nn.Sequential(TinyBlock(), TinyBlock())
    assert all(m.ops is TORCH_LAYER_OPS for m in model.modules() if isinstance(m, LayerOpsModule))
    ops = RecordingOps()
    assert bind_layer_ops(model, ops) == 6  # norm, act, attn per block
    block = model[0]
    x = _randn(2, 8)
    block.norm(x)
    block.norm.add_and_norm(x, None)
    block.act(_randn(2, 16))
    block.attn(_randn(2, 1, 8), torch.ones(2, 1, 4), torch.zeros(2, 1, 4))
    # (torch's add_rms_norm norms through its own rms_norm)
    assert ops.calls == ["rms_norm", "add_rms_norm", "rms_norm", "silu_and_mul", "rotary_neox_"]
    # binding is per instance: a fresh module still uses torch, and the ops are not state
    assert RMSNorm(8, EPS, torch.float32).ops is TORCH_LAYER_OPS
    assert set(block.state_dict()) == {"norm.weight"}
    assert "ops=recording" in repr(block.norm)


def test_rms_norm_module_over_heads_as_qwen3s_q_norm_uses_it() -> None:
    """[T, heads, head_dim], a strided view of a fused projection: normed over head_dim."""
    norm = RMSNorm(8, EPS, torch.float32)
    norm.weight.data.copy_(_randn(8, seed=3))
    fused = _randn(3, 5 * 8)
    heads = fused[:, : 4 * 8].view(3, 4, 8)
    torch.testing.assert_close(norm(heads), F.rms_norm(heads.contiguous(), (8,), norm.weight, EPS))


def test_add_and_norm_goes_through_the_bound_ops_with_the_modules_weight_and_eps() -> None:
    norm = RMSNorm(8, 1e-3, torch.float32)
    norm.weight.data.copy_(_randn(8, seed=4))
    seen: dict[str, Any] = {}

    class Spy(TorchLayerOps):
        name = "spy"

        def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> Any:
            seen.update(weight=weight, eps=eps)
            return super().add_rms_norm(x, residual, weight, eps)

    bind_layer_ops(norm, Spy())
    x, r = _randn(2, 8), _randn(2, 8, seed=1)
    normed, summed = norm.add_and_norm(x, r)
    assert seen["weight"] is norm.weight and seen["eps"] == 1e-3
    torch.testing.assert_close(normed, F.rms_norm(x + r, (8,), norm.weight, 1e-3))


def test_platform_default_is_torch_ops() -> None:
    assert Platform().layer_ops(torch.float32) is None
