"""pagoda's CPU matmul: ``x @ W^T (+ b)`` from a weight packed once into 32-column panels (AVX-512).

A C++ kernel (``csrc/gemm.cpp``) built once per machine through ``pagoda.cpp_extension``:
float32 on AVX-512F, bfloat16 on AVX512_BF16 (``vdpbf16ps``). It beats both the GEMV and
oneDNN's packed matmul at every row count measured (figures in the source), so where the CPU
has it, it serves every linear layer of its dtypes alone, from one packed copy of each weight;
see ``pagoda_platform_cpu.platform`` for the choice and ``pagoda_platform_cpu.linear`` for the
paths other CPUs take.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagoda.cpp_extension import CppExtension

EXTENSION_NAME = "pagoda_cpu_gemm"
SOURCE = "csrc/gemm.cpp"
EXTENSION = CppExtension(EXTENSION_NAME, "pagoda_platform_cpu", [SOURCE])
PANEL = 32  # output columns per packed panel (kPanel in the source)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_STEP = {torch.float32: 1, torch.bfloat16: 2}  # k values per packed element group
_NEEDS = {torch.float32: "AVX-512F", torch.bfloat16: "AVX512_BF16 (with AVX512BW and AVX512VL)"}

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class GemmLibrary:
    """The library's entry points with their C signatures, declared once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.supports = library.pagoda_gemm_supports
        self.supports.argtypes, self.supports.restype = [_int], _int
        self.pack = {}
        self.gemm = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            pack = getattr(library, f"pagoda_gemm_pack_{suffix}")
            pack.argtypes, pack.restype = [_p, _p, _i64, _i64, _int], None
            self.pack[dtype] = pack
            gemm = getattr(library, f"pagoda_gemm_{suffix}")
            gemm.argtypes, gemm.restype = [_p, _i64, _i64, _i64, _p, _i64, _p, _p, _i64, _int], _int
            self.gemm[dtype] = gemm


_library: GemmLibrary | None = None


def kernel() -> GemmLibrary:
    """The compiled library; builds it (or waits for its build) on first use. Raises ExtensionBuildError when it cannot be built."""
    global _library
    if _library is None:
        _library = GemmLibrary(EXTENSION.library())
    return _library


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run ``dtype`` here (no build, no such instructions), or None."""
    if dtype not in _DTYPE_CODES:
        return f"{dtype} is not covered (float32 and bfloat16 are)"
    failure = EXTENSION.build_failure()
    if failure is not None:
        return failure
    if not kernel().supports(_DTYPE_CODES[dtype]):
        return f"this CPU has no {_NEEDS[dtype]}"
    return None


@dataclass(frozen=True)
class PackedWeight:
    packed: torch.Tensor  # [ceil(N/32), k-steps, 32, elements per k-step]
    out_features: int
    in_features: int


class PackedGemmKernel:
    """A ``LinearKernel``: ``prepare`` packs the weight, ``apply`` multiplies; float32 and bfloat16."""

    name = "cpu_packed_gemm"

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> None:
        self._lib = kernel()
        self.dtypes = dtypes

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes and weight.numel() > 0

    def prepare(self, weight: torch.Tensor) -> PackedWeight:
        """[N, K] -> [ceil(N/32), k-steps, 32, step] (step = 2 for bf16, 1 for fp32), zero-padded."""
        dtype = weight.dtype
        if weight.dim() != 2 or not weight.is_cpu or dtype not in _DTYPE_CODES or not self._lib.supports(_DTYPE_CODES[dtype]):
            raise RuntimeError(f"gemm_pack: a CPU weight [N, K] of a dtype this build supports expected, got {dtype}")
        weight = weight.contiguous()
        n, k = weight.shape
        step = _STEP[dtype]
        packed = torch.zeros((-(-n // PANEL), -(-k // step), PANEL, step), dtype=dtype)
        self._lib.pack[dtype](weight.data_ptr(), packed.data_ptr(), n, k, torch.get_num_threads())
        return PackedWeight(packed, n, k)

    def apply(self, x: torch.Tensor, prepared: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return self._gemm(x, prepared, bias)
        rows = x.reshape(-1, x.shape[-1])
        return self._gemm(rows, prepared, bias).reshape(*x.shape[:-1], -1)

    def _gemm(self, x: torch.Tensor, prepared: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        packed = prepared.packed
        dtype = x.dtype
        if dtype != packed.dtype or not x.is_cpu:
            raise RuntimeError(f"gemm: CPU x in the packed weight's dtype expected (x's dtype is {dtype}, the weight's {packed.dtype})")
        m, k = x.shape
        n = prepared.out_features
        if k != prepared.in_features:
            raise RuntimeError(f"gemm: x has {k} columns and N is {n}, the packed weight does not fit them")
        if x.stride(1) != 1:
            x = x.contiguous()
        bias_ptr = None
        if bias is not None:
            if bias.numel() != n:
                raise RuntimeError(f"gemm: bias of [{n}] expected")
            # float32, padded to whole panels, so the last panel's bias load stays in bounds.
            padded = torch.zeros(packed.shape[0] * PANEL, dtype=torch.float32)
            padded[:n] = bias.reshape(n)
            bias = padded
            bias_ptr = padded.data_ptr()
        y = torch.empty((m, n), dtype=dtype)
        if m and self._lib.gemm[dtype](
            x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), packed.shape[0], bias_ptr, y.data_ptr(), n,
            torch.get_num_threads(),
        ):
            raise RuntimeError(f"gemm: this build has no {dtype} kernel")
        return y
