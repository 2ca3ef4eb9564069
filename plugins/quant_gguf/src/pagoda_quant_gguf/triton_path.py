"""When the ``gguf`` method runs its Triton kernel (``triton_kernels``), imported only then.

The kernel runs on CUDA / ROCm tensors where triton is installed, as pagoda-kernels' own Triton
kernels do; on CPU tensors only when asked for (``PAGODA_KERNELS_IMPL=triton``) under Triton's
interpreter (``TRITON_INTERPRET=1``, a correctness check: far slower than the C++ kernel).
``PAGODA_KERNELS_IMPL=torch`` or ``PAGODA_GGUF_KERNEL=0`` keeps the torch reference.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch
from gguf import GGMLQuantizationType as Q

from pagoda import envs

# every block type dequant serves (the float types need no kernel: F.linear runs them)
TRITON_TYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                                          Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))


@lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def supports(qtype: int, x: torch.Tensor) -> bool:
    if qtype not in TRITON_TYPES or not envs.PAGODA_GGUF_KERNEL or x.dtype not in (torch.float32, torch.float16,
                                                                                     torch.bfloat16):
        return False
    impl = envs.PAGODA_KERNELS_IMPL
    if impl == "torch" or not triton_available():
        return False
    if x.device.type == "cuda":
        return True
    return impl == "triton" and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    from pagoda_quant_gguf import triton_kernels

    return triton_kernels.matmul(x, blocks, qtype, cols)
