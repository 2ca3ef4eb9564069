"""The uninitialised embedding layer (token ids or learned absolute positions -> vectors).

Linear layers, RMSNorm and SiLU-and-mul come from core (``pagoda.layers``): the
platform picks their matmul and elementwise kernels.

Parameters are allocated with ``torch.empty``: every one is overwritten by
``load_weights``, and a random init of a billion-parameter model costs seconds
on a CPU for nothing. Allocation follows the ambient ``torch.device`` context,
so the runner may build the model on the meta device or straight on its target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagoda.quantization.base_config import EmbeddingMethodBase


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        # Set by pagoda.quantization.quantize_model: the table stays quantized and lookups dequantize their rows.
        self.quant_method: EmbeddingMethodBase | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        return F.embedding(input_ids, self.weight)
