"""RMSNorm, alone or fused with the residual add before it; the math comes from the bound ``LayerOps``."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.ops import LayerOpsModule


class RMSNorm(LayerOpsModule):
    """RMSNorm over the last dim (float32 accumulation); ``weight`` is [hidden_size].

    The parameter is allocated with ``torch.empty``: ``load_weights`` overwrites it.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); with no residual yet, x itself becomes the residual.

        ``residual`` may be overwritten with the sum (``LayerOps.add_rms_norm``): pass one
        that nothing else reads, and use the returned sum from then on.
        """
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, ops={self.ops.name}"
