"""Idefics3's SigLIP vision transformer, on core's layers.

Every projection is a core ``Linear`` (the patch embedding too: the stride-``patch`` convolution, with its
bias, is a matmul over the unfolded patches); its blocks are core's ``VisionEncoder`` (bidirectional
attention over each frame's patches, not paged).

Idefics3's embeddings take frames of any size: positions are the frame's patch grid bucketed onto the
``image_size / patch_size`` grid of the position table (transformers' NaViT-style fractional coordinates).
Its processor resizes every frame (each tile and the global image) to the same square, so no patch is
padding; a frame with padded pixels is refused rather than attended over without its mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers import Embedding, LayerNorm, Linear
from pagoda.layers.vision_encoder import VisionEncoder


def _position_ids(patches_h: int, patches_w: int, per_side: int, device: torch.device) -> torch.Tensor:
    """[patches_h * patches_w] position-table rows for a full frame of that patch grid."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device)

    def buckets(n: int) -> torch.Tensor:
        coords = torch.clamp(torch.arange(n, device=device, dtype=torch.float32) * (1.0 / n), max=1.0 - 1e-6)
        return torch.bucketize(coords, boundaries, right=True)

    return (buckets(patches_h)[:, None] * per_side + buckets(patches_w)[None, :]).reshape(-1)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.per_side = cfg.image_size // cfg.patch_size
        self.patch_embedding = Linear(cfg.num_channels * cfg.patch_size**2, cfg.hidden_size, True, dtype)
        self.position_embedding = Embedding(self.per_side**2, cfg.hidden_size, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[F, C, H, W] -> [F, patches, hidden]."""
        f, c, h, w = pixel_values.shape
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"a {h}x{w} frame is not a whole number of {p}-pixel patches")
        # (channel, row, column) within a patch: the order of the convolution weight's flattening
        patches = pixel_values.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(-1, c * p * p)
        embeds = self.patch_embedding(patches).view(f, (h // p) * (w // p), -1)
        return embeds + self.position_embedding(_position_ids(h // p, w // p, self.per_side, pixel_values.device))


class Idefics3VisionTransformer(nn.Module):
    """The tower (transformers' names): embeddings, encoder layers, ``post_layernorm``."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(cfg, dtype)
        self.encoder = VisionEncoder(cfg, dtype)
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[F, C, H, W] -> the last hidden states [F, patches, hidden]."""
        embeds = self.embeddings(pixel_values)
        f, length, hidden = embeds.shape
        x = embeds.reshape(f * length, hidden)
        for layer in self.encoder.layers:
            x = layer(x, f)
        return self.post_layernorm(x).view(f, length, hidden)
