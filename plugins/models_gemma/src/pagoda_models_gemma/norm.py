"""Gemma's RMSNorm: core's RMSNorm, whose checkpoint weight is ``scale - 1``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers import RMSNorm


class GemmaRMSNorm(RMSNorm):
    """Scales by ``1 + checkpoint weight``; ``weight_loader`` folds the 1 into ``weight`` once, at load time,
    so the platform's fused RMSNorm kernels serve it unchanged.

    The 1 is added in float32, before the cast to the model dtype. In float32 the result is the
    very ``1.0 + weight.float()`` transformers multiplies by, so the norm is unchanged. In bfloat16
    transformers keeps ``1 + weight`` and the normalised activations in float32 and rounds once,
    after the product; here ``1 + weight`` is rounded to bfloat16 at load time and core's RMSNorm
    rounds the normalised activations before the product (as Llama's does), so a Gemma norm's
    bfloat16 output may differ from transformers' by one or two bfloat16 ulps.
    """

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if tuple(param.shape) != tuple(loaded_weight.shape):
            raise ValueError(f"the model expects {tuple(param.shape)}")
        param.data.copy_(loaded_weight.float() + 1.0)
