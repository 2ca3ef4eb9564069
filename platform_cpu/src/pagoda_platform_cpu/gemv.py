"""The decode-sized matmul: ``x @ W^T (+ b)`` for a few rows of ``x``, read straight from the plain weight.

A C++ kernel (``csrc/gemv.cpp``) built once per machine through ``pagoda.cpp_extension``.
At a handful of rows a linear layer is a read of its weight; this kernel streams it at
the memory's speed (one forward pass per thread over its share of the rows), where oneDNN's
packed matmul reads at 60-80% of that. See ``pagoda_platform_cpu.linear`` for when it is used.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension

EXTENSION_NAME = "pagoda_cpu_gemv"
SOURCE = "csrc/gemv.cpp"
EXTENSION = CppExtension(EXTENSION_NAME, "pagoda_platform_cpu", [SOURCE])



class GemvLibrary:
    """The library's entry points by dtype, and the wrapper that checks their arguments."""

    def __init__(self, library: ModuleType) -> None:
        self.isa = library.pagoda_gemv_isa
        self.by_dtype = {torch.float32: library.pagoda_gemv_f32, torch.bfloat16: library.pagoda_gemv_bf16}

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] times the contiguous weight [N, K], transposed, plus bias [N]: [M, N] in x's dtype."""
        if x.dim() != 2 or weight.dim() != 2:
            raise RuntimeError("gemv: x [M, K] and weight [N, K] expected")
        m, k = x.shape
        n, wk = weight.shape
        if k != wk:
            raise RuntimeError(f"gemv: x has {k} columns, weight {wk}")
        if x.dtype != weight.dtype:
            raise RuntimeError("gemv: x and weight dtypes differ")
        if not (weight.is_contiguous() and weight.is_cpu and x.is_cpu):
            raise RuntimeError("gemv: contiguous CPU weight expected")
        fn = self.by_dtype.get(x.dtype)
        if fn is None:
            raise RuntimeError(f"gemv: float32 or bfloat16 expected, got {x.dtype}")
        x = x.contiguous()
        bias_ptr = None
        if bias is not None:
            if bias.numel() != n or bias.dtype != x.dtype:
                raise RuntimeError(f"gemv: bias of [{n}] in x's dtype expected")
            bias = bias.contiguous()
            bias_ptr = bias.data_ptr()
        y = torch.empty((m, n), dtype=x.dtype)
        fn(x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, torch.get_num_threads())
        return y


_library: GemvLibrary | None = None


def kernel() -> GemvLibrary:
    """The compiled library; builds it (or waits for its build) on first use. Raises ExtensionBuildError when it cannot be built."""
    global _library
    if _library is None:
        _library = GemvLibrary(EXTENSION.library())
    return _library


def build_failure() -> str | None:
    """Why the kernel is unusable here, or None once it is built (building it if needed)."""
    return EXTENSION.build_failure()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] times the contiguous ``weight`` [N, K], transposed, plus ``bias``: [..., N] in x's dtype.

    fp32 or bf16, x and weight of one dtype. Accumulates in fp32; a bf16 result is rounded once.
    """
    lead = x.shape[:-1]
    out = kernel().gemv(x.reshape(-1, x.shape[-1]), weight, bias)
    return out if x.dim() == 2 else out.reshape(*lead, weight.shape[0])
