"""The attention layer model code uses; the backend and KV cache are bound by the runner."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagoda.attention.interface import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged attention over the engine's KV cache.

    Model code builds one per decoder layer and calls it with q/k/v already
    projected (and rotated). The model runner binds ``backend`` and ``kv_cache``
    before the first step, so model code carries no attention plumbing.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        layer_idx: int = 0,
        causal: bool = True,
        alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.layer_idx = layer_idx
        # False: bidirectional attention (encoder-only models); the backend reads it from its AttentionSpec
        self.causal = causal
        # ALiBi (pagoda.layers.get_alibi_slopes, scaled as the model needs): [num_heads] float32, a
        # buffer so it follows the model's device (and is never saved)
        self.alibi_slopes: torch.Tensor | None
        if alibi_slopes is None:
            self.alibi_slopes = None
        else:
            slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32).flatten()
            if slopes.numel() != num_heads:
                raise ValueError(f"ALiBi needs one slope per head: {slopes.numel()} slopes for {num_heads} heads")
            self.register_buffer("alibi_slopes", slopes.clone(), persistent=False)
        self.backend: AttentionBackend | None = None
        self.kv_cache: torch.Tensor | None = None

    def alibi_slopes_tuple(self) -> tuple[float, ...] | None:
        """The slopes as ``AttentionSpec.alibi_slopes`` carries them."""
        return None if self.alibi_slopes is None else tuple(float(s) for s in self.alibi_slopes.tolist())

    def bind(self, backend: AttentionBackend, kv_cache: torch.Tensor) -> None:
        self.backend = backend
        self.kv_cache = kv_cache

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, num_heads*head_dim], k/v: [T, num_kv_heads*head_dim] -> [T, num_heads*head_dim]."""
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache bound; the model runner binds it")
        t = query.shape[0]
        # passed only when set, so a backend written before ALiBi keeps its signature
        extra = {} if self.alibi_slopes is None else {"alibi_slopes": self.alibi_slopes}
        out = self.backend.forward(
            query.view(t, self.num_heads, self.head_dim),
            key.view(t, self.num_kv_heads, self.head_dim),
            value.view(t, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            **extra,
        )
        return out.reshape(t, self.num_heads * self.head_dim)
