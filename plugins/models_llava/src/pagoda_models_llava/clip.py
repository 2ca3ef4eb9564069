"""CLIP's vision transformer (what LLaVA 1.5 encodes images with), on core's layers.

Every projection is a core ``Linear`` (the patch embedding too: a stride-``patch`` convolution is a matmul
over the unfolded patches), so the platform's linear kernel runs the tower as it runs the decoder.
Activations stay 2-D ([images x tokens, hidden]) for those kernels; attention is bidirectional over each
image's tokens (core's ``attend``, no mask, not causal), not paged: a tower's tokens are not cached.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.attention.sdpa import attend
from pagoda.layers import Activation, Embedding, LayerNorm, Linear


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.patch_embedding = Linear(3 * cfg.patch_size**2, cfg.hidden_size, False, dtype)
        self.position_embedding = Embedding(self.num_patches + 1, cfg.hidden_size, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, 1 + patches, hidden]."""
        b, c, h, w = pixel_values.shape
        p = self.patch_size
        if (h // p) * (w // p) != self.num_patches:
            raise ValueError(f"the image is {h}x{w} pixels; this vision tower takes {self.num_patches} patches of {p}")
        # (channel, row, column) within a patch: the order of the convolution weight's flattening
        patches = pixel_values.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(-1, c * p * p)
        embeds = self.patch_embedding(patches).view(b, self.num_patches, -1)
        cls = self.class_embedding.expand(b, 1, -1)
        positions = torch.arange(self.num_patches + 1, device=pixel_values.device)
        return torch.cat([cls, embeds], dim=1) + self.position_embedding(positions)


class CLIPAttention(nn.Module):
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


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(cfg, dtype)
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = CLIPMLP(cfg, dtype)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), num_images)
        return x + self.mlp(self.layer_norm2(x))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        self.act = Activation(cfg.hidden_act)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))


class CLIPVisionModel(nn.Module):
    """The tower; ``forward`` returns the hidden states after the layers asked for (transformers' indexing:
    0 = the embeddings after ``pre_layrnorm``, -1 = the last layer's output)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(cfg, dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)  # (sic: transformers' name)
        self.encoder = CLIPEncoder(cfg, dtype)
        # loaded with the checkpoint; LLaVA reads hidden states before it
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, pixel_values: torch.Tensor, feature_layers: list[int]) -> list[torch.Tensor]:
        """-> the hidden states [B, 1 + patches, hidden] after each of ``feature_layers``."""
        num_layers = len(self.encoder.layers)
        wanted = [i if i >= 0 else num_layers + 1 + i for i in feature_layers]
        if any(not 0 <= i <= num_layers for i in wanted):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's {num_layers} layers")
        embeds = self.pre_layrnorm(self.embeddings(pixel_values))
        b, length, hidden = embeds.shape
        x = embeds.reshape(b * length, hidden)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = layer(x, b)
            states[i] = x
        return [states[i].view(b, length, hidden) for i in wanted]
