"""Linear layers on oneDNN with weights pre-packed into its blocked layout.

``F.linear`` hands MKL/oneDNN a plain [out, in] weight, which is re-blocked on
every call; at decode batch sizes that dominates. Packing once after loading
measured, on the 2-core AVX512 reference VM (GFLOP/s, F.linear -> packed):
fp32 M=64 122-165 -> 161-212, LM head (49152 x 576) 81 -> 190; bf16 M=1 12-21 -> 23-57,
M=64 161-273 -> 296-355. Numerics are oneDNN's (fp32 accumulation), as for F.linear.
"""

from __future__ import annotations

from typing import Any

import torch

# Batch-size hint for the packed layout: decode batches are tens of rows, and the
# layout chosen for 64 measured as fast at 1 and 512 rows as each size's own.
PACK_BATCH_HINT = 64


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinearKernel:
    name = "onednn_packed"

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> None:
        self.dtypes = dtypes

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes and weight.numel() > 0

    def prepare(self, weight: torch.Tensor) -> Any:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)

    def apply(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), prepared, bias, "none", [], "")
