"""When the ``compressed-tensors`` method runs its Triton kernels (``triton_kernels``), imported only then.

They run on CUDA / ROCm tensors where triton is installed, as pagoda-kernels' own Triton kernels
do; on CPU tensors only when asked for (``PAGODA_KERNELS_IMPL=triton``) under Triton's
interpreter (``TRITON_INTERPRET=1``, a correctness check). ``PAGODA_KERNELS_IMPL=torch`` or
``PAGODA_INT8_KERNEL=0`` keeps the torch reference.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

from pagoda import envs


@lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def asked_on_cpu() -> bool:
    """Triton asked for on CPU tensors (``PAGODA_KERNELS_IMPL=triton`` under the interpreter): a CPU layer
    then keeps its weight unpacked for the Triton kernels instead of packing it for the C++ library."""
    return (envs.PAGODA_KERNELS_IMPL == "triton" and envs.PAGODA_INT8_KERNEL != "0" and triton_available()
            and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def supports(x: torch.Tensor) -> bool:
    if envs.PAGODA_INT8_KERNEL == "0" or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    impl = envs.PAGODA_KERNELS_IMPL
    if impl == "torch" or not triton_available():
        return False
    if x.device.type == "cuda":
        return True
    return impl == "triton" and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
