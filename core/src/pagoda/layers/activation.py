"""MLP activations: gated (SiLU-and-mul, GELU-and-mul) and plain, by their Hugging Face ``hidden_act`` names.

SiLU-and-mul goes through the bound ``LayerOps`` (the CPU platform fuses it);
the others are single torch calls already, whose rounding matches transformers'
``ACT2FN`` bit for bit in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.ops import LayerOpsModule


class SiluAndMul(LayerOpsModule):
    """[T, 2 * I] (gate then up, as one fused projection writes them) -> silu(gate) * up, [T, I]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)

    def extra_repr(self) -> str:
        return f"ops={self.ops.name}"


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's tanh approximation written out (transformers' NewGELUActivation); F.gelu's tanh
    # variant rounds differently in float32.
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation_names() -> tuple[str, ...]:
    return tuple(sorted(_ACTIVATIONS))


class Activation(nn.Module):
    """A plain (non-gated) activation chosen by its Hugging Face name."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in _ACTIVATIONS:
            raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(activation_names())}")
        self.name = name
        self.fn = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


class GeluAndMul(nn.Module):
    """[T, 2 * I] (gate then up) -> gelu(gate) * up: GeGLU (Gemma's ``gelu_pytorch_tanh``, ``gelu``)."""

    def __init__(self, name: str = "gelu_pytorch_tanh") -> None:
        super().__init__()
        if name not in ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            raise ValueError(f"GeluAndMul does not support activation {name!r}")
        self.name = name
        self.fn = _ACTIVATIONS[name]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.fn(gate) * up

    def extra_repr(self) -> str:
        return self.name


def gated_activation(name: str) -> nn.Module:
    """The gated activation for an MLP whose fused projection holds gate then up (``hidden_act`` names)."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    return GeluAndMul(name)
