"""When the ``gguf`` method runs its Triton kernel (``triton_kernels``), imported only then.

Where Triton serves an input is core's choice for every method (``pagoda.triton_utils``: CUDA /
ROCm tensors, or CPU tensors under ``PAGODA_KERNELS_IMPL=triton`` and ``TRITON_INTERPRET=1``, a
correctness check far slower than the C++ kernel); ``PAGODA_GGUF_KERNEL=0`` keeps this method's
torch reference as well.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from pagoda import envs
from pagoda.triton_utils import triton_available, triton_serves

__all__ = ["TRITON_TYPES", "matmul", "supports", "triton_available"]

# every block type dequant serves (the float types need no kernel: F.linear runs them)
TRITON_TYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                                          Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))


def supports(qtype: int, x: torch.Tensor) -> bool:
    return qtype in TRITON_TYPES and bool(envs.PAGODA_GGUF_KERNEL) and triton_serves(x)


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    from pagoda_quant_gguf import triton_kernels

    return triton_kernels.matmul(x, blocks, qtype, cols)
