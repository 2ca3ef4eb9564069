"""When the ``compressed-tensors`` method runs its Triton kernels (``triton_kernels``), imported only then.

Where Triton serves an input is core's choice for every method (``pagoda.triton_utils``: CUDA /
ROCm tensors, or CPU tensors under ``PAGODA_KERNELS_IMPL=triton`` and ``TRITON_INTERPRET=1``);
``PAGODA_INT8_KERNEL=0`` keeps this method's torch reference as well.
"""

from __future__ import annotations

import torch

from pagoda import envs
from pagoda.triton_utils import triton_asked_on_cpu, triton_available, triton_serves

__all__ = ["asked_on_cpu", "supports", "triton_available"]


def asked_on_cpu() -> bool:
    """Triton asked for on CPU tensors: a CPU layer then keeps its weight unpacked for the Triton kernels
    instead of packing it for the C++ library."""
    return envs.PAGODA_INT8_KERNEL != "0" and triton_asked_on_cpu()


def supports(x: torch.Tensor) -> bool:
    return envs.PAGODA_INT8_KERNEL != "0" and triton_serves(x)
