"""LayerNorm over each attention head with that head's own weight (StableLM 2's ``qk_layernorm``).

transformers keeps one ``nn.LayerNorm`` per head (``StableLmLayerNormPerHead``,
checkpoint names ``q_layernorm.norms.<head>.weight``) and runs them in a Python
loop over the heads. Here the weights are one [num_heads, head_dim] parameter and
the whole [T, heads, head_dim] block is normalised in one call, then scaled per
head; the model family's loader puts checkpoint row ``norms.<h>`` into row ``h``.

A qk-norm that shares one weight across heads (Phi's) is plain ``LayerNorm`` over
``head_dim``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PerHeadLayerNorm(nn.Module):
    """[T, num_heads, head_dim] -> LayerNorm over head_dim, scaled (and shifted) by each head's own parameters."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.eps = eps
        # torch.empty: the loader fills every row
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_heads, head_dim, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != self.weight.shape:
            raise ValueError(f"PerHeadLayerNorm of {tuple(self.weight.shape)} got input {tuple(x.shape)}")
        normed = F.layer_norm(x, (self.head_dim,), None, None, self.eps) * self.weight
        return normed if self.bias is None else normed + self.bias

    def extra_repr(self) -> str:
        return f"{self.num_heads}, {self.head_dim}, eps={self.eps}, bias={self.bias is not None}"
