"""pagoda.layers.Linear: plain F.linear until a platform kernel prepares it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers import Linear, LinearKernel, prepare_linear_layers


class ScaledKernel:
    """Keeps the weight doubled, halves the product: a visible, exact transformation."""

    name = "scaled"

    def __init__(self) -> None:
        self.prepared: list[tuple[int, ...]] = []

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32

    def prepare(self, weight: torch.Tensor) -> Any:
        self.prepared.append(tuple(weight.shape))
        return weight * 2

    def apply(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, prepared, None if bias is None else bias * 2) / 2


def _filled(layer: Linear, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
    return layer


def test_unprepared_linear_is_f_linear() -> None:
    layer = _filled(Linear(8, 5, True, torch.float32), 0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)


def test_prepared_layers_use_the_kernel_and_release_unshared_weights() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 8)
            self.proj = _filled(Linear(8, 6, True, torch.float32), 1)
            self.head = Linear(8, 11, False, torch.float32)
            self.head.weight = self.embed.weight  # tied
            self.low = Linear(8, 4, False, torch.bfloat16)  # the kernel refuses bf16

    model = Tiny()
    x = torch.randn(4, 8)
    want_proj = model.proj(x)
    want_head = x @ model.embed.weight.T
    kernel = ScaledKernel()
    assert isinstance(kernel, LinearKernel)
    assert prepare_linear_layers(model, kernel) == 2
    assert sorted(kernel.prepared) == [(6, 8), (11, 8)]
    torch.testing.assert_close(model.proj(x), want_proj)
    torch.testing.assert_close(model.head(x), want_head)
    assert model.proj.weight.numel() == 0, "an unshared weight is released once prepared"
    assert model.head.weight is model.embed.weight, "a tied weight stays for its other user"
    assert model.low.kernel is None and model.low.weight.numel() == 32
    assert "kernel=scaled" in repr(model.proj)
    # preparing twice is a no-op
    assert prepare_linear_layers(model, kernel) == 0


class FusingKernel(ScaledKernel):
    """ScaledKernel plus a SiLU-and-mul it computes itself (and counts), as a platform's fused matmul would."""

    name = "fusing"

    def __init__(self) -> None:
        super().__init__()
        self.fused_calls = 0

    def supports_silu_and_mul(self, weight: torch.Tensor) -> bool:
        return self.supports(weight) and weight.shape[0] % 2 == 0

    def prepare_silu_and_mul(self, weight: torch.Tensor) -> Any:
        return ("gated", self.prepare(weight))

    def apply_silu_and_mul(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        self.fused_calls += 1
        gate, up = self.apply(x, prepared[1], bias).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def test_a_gate_up_projection_with_its_activation_fuses_where_the_kernel_can() -> None:
    from pagoda.layers import MergedColumnParallelLinear, SiluAndMulLinearKernel

    x = torch.randn(3, 8)
    for kernel in (FusingKernel(), ScaledKernel(), None):
        layer = _filled(MergedColumnParallelLinear(8, [5, 5], True, torch.float32, activation="silu_and_mul"), 2)
        gate, up = torch.nn.functional.linear(x, layer.weight, layer.bias).chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        if kernel is not None:
            assert prepare_linear_layers(layer, kernel) == 1
        out = layer(x)
        assert out.shape == (3, 5)
        torch.testing.assert_close(out, want)
        if isinstance(kernel, FusingKernel):
            assert isinstance(kernel, SiluAndMulLinearKernel) and kernel.fused_calls == 1
            assert layer.fused_activation and "activation fused" in repr(layer)
        else:
            assert not isinstance(kernel, SiluAndMulLinearKernel) and not layer.fused_activation


def test_a_gate_up_activation_other_than_silu_and_mul_of_two_halves_is_refused() -> None:
    import pytest

    from pagoda.layers import MergedColumnParallelLinear

    with pytest.raises(ValueError, match="silu_and_mul"):
        MergedColumnParallelLinear(8, [5, 5], False, torch.float32, activation="gelu_and_mul")
    with pytest.raises(ValueError, match="two equal projections"):
        MergedColumnParallelLinear(8, [5, 6], False, torch.float32, activation="silu_and_mul")
