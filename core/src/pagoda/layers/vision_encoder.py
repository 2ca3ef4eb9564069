"""The pre-norm transformer block of ViT-style vision towers (CLIP's, SigLIP's), on core's layers.

Towers' blocks share one layout and one set of checkpoint names (``layer_norm1``, ``self_attn.{q,k,v,out}_proj``,
``layer_norm2``, ``mlp.fc1`` / ``mlp.fc2``), so the multimodal families build theirs from this one. Activations
stay 2-D ([images x tokens, hidden]) for the platform's linear kernels; attention is bidirectional over each
image's tokens (core's ``attend``, no mask, not causal) and not paged: a tower's tokens are not cached.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.attention.sdpa import attend
from pagoda.layers.activation import Activation
from pagoda.layers.linear import Linear
from pagoda.layers.norm import LayerNorm


class VisionAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = Linear(cfg.hidden_size, cfg.hidden_size, True, dtype)
        self.k_proj = Linear(cfg.hidden_size, cfg.hidden_size, True, dtype)
        self.v_proj = Linear(cfg.hidden_size, cfg.hidden_size, True, dtype)
        self.out_proj = Linear(cfg.hidden_size, cfg.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        """[B * L, hidden] -> [B * L, hidden]; every token of an image sees all of that image's tokens."""
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(num_images, -1, self.num_heads, self.head_dim).transpose(1, 2)

        out = attend(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), None, self.scale, None,
                     causal=False)
        return self.out_proj(out.transpose(1, 2).reshape(x.shape))


class VisionMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        self.act = Activation(cfg.hidden_act)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """``cfg``: a vision config with hidden_size, num_attention_heads, intermediate_size, hidden_act and
    layer_norm_eps (transformers' CLIPVisionConfig, SiglipVisionConfig, Idefics3VisionConfig)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = VisionAttention(cfg, dtype)
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = VisionMLP(cfg, dtype)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), num_images)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The towers' ``encoder``: ``layers`` of ``VisionEncoderLayer`` (a tower runs them, reading what it needs)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
