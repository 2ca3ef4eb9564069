"""Choose between a Triton kernel and its plain-torch reference.

Triton runs when the tensors live on a GPU (CUDA or ROCm/HIP). On CPU tensors
it runs only under Triton's interpreter (``TRITON_INTERPRET=1``, set before the
kernels are first imported) and only when asked for, either per call
(``impl="triton"``) or process-wide (``PAGODA_KERNELS_IMPL=triton``): the
interpreter is a correctness tool, orders of magnitude slower than torch.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Literal

import torch

Impl = Literal["auto", "triton", "torch"]
IMPL_ENV = "PAGODA_KERNELS_IMPL"
_IMPLS = ("auto", "triton", "torch")


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was asked for where it cannot run."""


@lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested_impl(impl: Impl = "auto") -> Impl:
    """The per-call choice, else ``PAGODA_KERNELS_IMPL``, else auto."""
    chosen = impl if impl != "auto" else os.environ.get(IMPL_ENV, "auto") or "auto"
    if chosen not in _IMPLS:
        raise ValueError(f"kernel impl {chosen!r} is not one of {', '.join(_IMPLS)} (from impl= or {IMPL_ENV})")
    return chosen  # type: ignore[return-value]


def use_triton(device: torch.device, impl: Impl = "auto") -> bool:
    """True when the Triton kernel should run for tensors on ``device``."""
    chosen = requested_impl(impl)
    if chosen == "torch":
        return False
    on_gpu = device.type == "cuda"
    if chosen == "auto":
        return on_gpu and triton_available()
    if not triton_available():
        raise KernelUnavailableError("impl='triton' was asked for but triton is not installed (pip install triton)")
    if not on_gpu and not interpret_mode():
        raise KernelUnavailableError(
            f"impl='triton' was asked for on {device.type} tensors; Triton needs a CUDA/ROCm device, "
            "or TRITON_INTERPRET=1 set before pagoda_kernels' Triton kernels are imported"
        )
    return True


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
