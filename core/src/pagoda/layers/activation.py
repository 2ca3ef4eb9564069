"""SiLU-and-mul, the activation of gated MLPs; the math comes from the bound ``LayerOps``."""

from __future__ import annotations

import torch

from pagoda.layers.ops import LayerOpsModule


class SiluAndMul(LayerOpsModule):
    """[T, 2 * I] (gate then up, as one fused projection writes them) -> silu(gate) * up, [T, I]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)

    def extra_repr(self) -> str:
        return f"ops={self.ops.name}"
