"""CLIP's vision transformer (what LLaVA 1.5 encodes images with), on core's layers.

Every projection is a core ``Linear`` (the patch embedding too: a stride-``patch`` convolution is a matmul
over the unfolded patches), so the platform's linear kernel runs the tower as it runs the decoder.
Its blocks are core's ``VisionEncoder`` (bidirectional attention over each image's tokens, not paged).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers import Embedding, LayerNorm, Linear
from pagoda.layers.vision_encoder import VisionEncoder


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


class CLIPVisionModel(nn.Module):
    """The tower; ``forward`` returns the hidden states after the layers asked for (transformers' indexing:
    0 = the embeddings after ``pre_layrnorm``, -1 = the last layer's output)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(cfg, dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)  # (sic: transformers' name)
        self.encoder = VisionEncoder(cfg, dtype)
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
