"""Rotary position embedding over a flat token batch, from a cos/sin table indexed by position."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.rope_scaling import RopeConfig, rope_angles


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE on the first ``rotary_dim`` channels of each head.

    The cos/sin table covers ``max_positions`` positions and is built once per
    device on first use. It is kept as a plain attribute, not a buffer, so it
    never appears in a state dict and survives a model built on the meta device
    and materialised later (the table is simply rebuilt where it is needed).
    """

    def __init__(self, config: RopeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.rotary_dim = config.rotary_dim
        self.max_positions = config.max_positions
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _build(self, device: torch.device) -> None:
        positions = torch.arange(self.max_positions, device=device, dtype=torch.int64).to(torch.float32)
        # float32 angles then cast, as transformers does, so fp32 models match it bit for bit.
        angles, attention_factor = rope_angles(self.config, positions)
        self._cos = (angles.cos() * attention_factor).to(self.dtype)
        self._sin = (angles.sin() * attention_factor).to(self.dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [T, 1, rotary_dim // 2] each, shared by every layer of a step.

        The rotation itself is ``LayerOps.rotary_neox_`` (platform kernels).
        """
        if self._cos is None or self._cos.device != positions.device:
            self._build(positions.device)
        assert self._cos is not None and self._sin is not None
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
