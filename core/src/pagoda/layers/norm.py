"""RMSNorm (alone or fused with the residual add before it, math from the bound ``LayerOps``) and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, with or without bias (GPT-2, OPT, GPT-NeoX, Falcon, Phi, StableLM).

    ``add_and_norm`` mirrors ``RMSNorm.add_and_norm`` so decoder layers read alike;
    the sum is a new tensor here (torch's ``layer_norm`` is already one fused call).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x if residual is None else x + residual
        return self.forward(summed), summed

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, bias={self.bias is not None}"
