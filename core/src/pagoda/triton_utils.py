"""Whether a quantization method's Triton kernel serves a tensor: the probe every method plugin shares.

A method's Triton kernels run on CUDA / ROCm tensors where triton is installed, as pagoda-kernels'
own Triton kernels do; on CPU tensors only when asked for (``PAGODA_KERNELS_IMPL=triton``) under
Triton's interpreter (``TRITON_INTERPRET=1``: a correctness check, far slower than a C++ kernel).
``PAGODA_KERNELS_IMPL=torch`` keeps each method's torch reference. Each method adds its own switch
(``PAGODA_GGUF_KERNEL``, ``PAGODA_INT8_KERNEL``, ...) on top. (pagoda-kernels makes the same choice
for its own kernels in ``pagoda_kernels.dispatch``; it does not depend on pagoda-core.)
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

from pagoda import envs

TRITON_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """triton is installed (checked once: importing it is left to the kernels' modules)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET`` set to anything but empty or 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_asked_on_cpu() -> bool:
    """Triton asked for on CPU tensors: ``PAGODA_KERNELS_IMPL=triton``, triton installed, the interpreter on."""
    return envs.PAGODA_KERNELS_IMPL == "triton" and triton_available() and triton_interpreting()


def triton_serves(x: torch.Tensor) -> bool:
    """A method's Triton kernel takes the floating-point input ``x`` (before the method's own switch)."""
    if x.dtype not in TRITON_INPUT_DTYPES or envs.PAGODA_KERNELS_IMPL == "torch" or not triton_available():
        return False
    if x.device.type == "cuda":  # ROCm's devices are "cuda" to torch as well
        return True
    return x.device.type == "cpu" and triton_asked_on_cpu()
