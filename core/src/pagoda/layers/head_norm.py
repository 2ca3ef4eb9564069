"""LayerNorm over each attention head with that head's own weight (StableLM 2's ``qk_layernorm``).

transformers keeps one ``nn.LayerNorm`` per head (``StableLmLayerNormPerHead``,
checkpoint names ``q_layernorm.norms.<head>.weight``) and runs them in a Python
loop over the heads. Here the weights are one [num_heads, head_dim] parameter and
the whole [T, heads, head_dim] block is normalised in one call, then scaled per
head. ``checkpoint_shards`` tells core's ``AutoWeightsLoader`` that checkpoint
tensor ``norms.<h>.weight`` is row ``h``; with tensor parallelism a rank holds
the rows of its own heads (``first_head`` on) and skips the others' tensors.

A qk-norm that shares one weight across heads (Phi's) is plain ``LayerNorm`` over
``head_dim``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class PerHeadLayerNorm(nn.Module):
    """[T, num_heads, head_dim] -> LayerNorm over head_dim, scaled (and shifted) by each head's own parameters."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, dtype: torch.dtype, bias: bool = False,
                 *, total_num_heads: int | None = None, first_head: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        # the checkpoint's heads, and which of them this rank holds (tensor parallelism)
        self.total_num_heads = num_heads if total_num_heads is None else total_num_heads
        self.first_head = first_head
        if not 0 <= first_head <= self.total_num_heads - num_heads:
            raise ValueError(f"heads {first_head}..{first_head + num_heads - 1} are not among {self.total_num_heads}")
        self.head_dim = head_dim
        self.eps = eps
        # torch.empty: the loader fills every row
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_heads, head_dim, dtype=dtype), requires_grad=False) if bias else None

    def checkpoint_shards(self) -> dict[str, tuple[str, int]]:
        """Checkpoint name (under this module) -> (parameter, head): one tensor per head and kind."""
        kinds = ["weight"] + (["bias"] if self.bias is not None else [])
        return {f"norms.{h}.{kind}": (kind, h) for kind in kinds for h in range(self.total_num_heads)}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if tuple(loaded_weight.shape) != (self.head_dim,):
            raise ValueError(f"the model expects ({self.head_dim},) per head")
        row = int(shard_id) - self.first_head
        if 0 <= row < self.num_heads:  # another rank's head otherwise
            param.data[row].copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != self.weight.shape:
            raise ValueError(f"PerHeadLayerNorm of {tuple(self.weight.shape)} got input {tuple(x.shape)}")
        normed = F.layer_norm(x, (self.head_dim,), None, None, self.eps) * self.weight
        return normed if self.bias is None else normed + self.bias

    def extra_repr(self) -> str:
        return f"{self.num_heads}, {self.head_dim}, eps={self.eps}, bias={self.bias is not None}"
