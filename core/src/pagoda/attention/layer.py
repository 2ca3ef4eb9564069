"""The attention layer model code uses; the backend and KV cache are bound by the runner."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from pagoda.attention.interface import AttentionBackend, AttentionLayerParams, AttentionMetadata
from pagoda.attention.kv_quant import K_SCALE_CONSTANT, V_SCALE_CONSTANT, is_fp8


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
        self._scale = float(scale)
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
        # fp8 KV cache scales (vLLM's names): the checkpoint's (load_kv_scale), else 1.0, unless
        # calculate_kv_scales derives them from the first step the runner enables it for (then it
        # turns itself off). 0-d float32 tensors on the cache's device, made by bind(), so a
        # captured graph reads their current values. A cache that is not fp8 uses none of them.
        self.calculate_kv_scales = False
        self._k_scale: torch.Tensor | None = None
        self._v_scale: torch.Tensor | None = None
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0
        self.kv_scales_from_checkpoint = False
        # what every backend call gets; bind() rebuilds it once the slopes and scales are on the cache's device
        self.params = self._layer_params()

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        # the transformers fallback sets its module's own scale on every call: rebuild only on a change
        if value != self._scale:
            self._scale = float(value)
            self.params = dataclasses.replace(self.params, scale=self._scale)

    def _layer_params(self) -> AttentionLayerParams:
        fp8 = self.kv_cache is not None and is_fp8(self.kv_cache.dtype)
        return AttentionLayerParams(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=self.alibi_slopes,
            k_scale=self._k_scale if fp8 else None,
            v_scale=self._v_scale if fp8 else None,
        )

    def alibi_slopes_tuple(self) -> tuple[float, ...] | None:
        """The slopes as ``AttentionSpec.alibi_slopes`` carries them."""
        return None if self.alibi_slopes is None else tuple(float(s) for s in self.alibi_slopes.tolist())

    def bind(self, backend: AttentionBackend, kv_cache: torch.Tensor) -> None:
        self.backend = backend
        self.kv_cache = kv_cache
        if is_fp8(kv_cache.dtype) and (self._k_scale is None or self._k_scale.device != kv_cache.device):
            # not inference tensors: those keep no version counter, by which a backend can tell a changed value
            with torch.inference_mode(False):
                self._k_scale = torch.tensor(self._k_scale_float, dtype=torch.float32, device=kv_cache.device)
                self._v_scale = torch.tensor(self._v_scale_float, dtype=torch.float32, device=kv_cache.device)
        self.params = self._layer_params()

    def load_kv_scale(self, which: str, value: float) -> None:
        """A checkpoint's per-layer ``k_scale`` (``which="k"``) or ``v_scale`` (pagoda.model_loader.kv_scales)."""
        if which not in ("k", "v") or not value > 0:
            raise ValueError(f"a KV cache scale is k or v and positive; got {which}={value}")
        setattr(self, f"_{which}_scale_float", float(value))
        self.kv_scales_from_checkpoint = True
        scale = self._k_scale if which == "k" else self._v_scale
        if scale is not None:  # already bound: the tensor a graph reads takes the new value
            scale.fill_(float(value))

    @torch.no_grad()
    def calc_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """vLLM's calculate_kv_scales: scale = max|x| / K_SCALE_CONSTANT (V_SCALE_CONSTANT), once."""
        assert self._k_scale is not None and self._v_scale is not None
        for scale, x, constant in ((self._k_scale, key, K_SCALE_CONSTANT), (self._v_scale, value, V_SCALE_CONSTANT)):
            amax = x.detach().abs().max().float() if x.numel() else torch.zeros((), device=x.device)
            # an all-zero input would give scale 0 (every later value saturates): keep 1.0 then
            scale.copy_(torch.where(amax > 0, amax / constant, torch.ones_like(amax)))
        self._k_scale_float = float(self._k_scale)
        self._v_scale_float = float(self._v_scale)
        self.calculate_kv_scales = False

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
        params = self.params
        if self.calculate_kv_scales and params.k_scale is not None:
            self.calc_kv_scales(key, value)  # in place: params holds the same scale tensors
        heads, kv_heads, head_dim = params.num_heads, params.num_kv_heads, params.head_dim
        out = self.backend.forward(
            query.view(t, heads, head_dim),
            key.view(t, kv_heads, head_dim),
            value.view(t, kv_heads, head_dim),
            self.kv_cache,
            metadata,
            params,
        )
        return out.reshape(t, heads * head_dim)
