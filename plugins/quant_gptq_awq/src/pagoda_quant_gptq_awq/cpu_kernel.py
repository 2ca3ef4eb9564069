"""The 4-bit CPU kernel (``csrc/int4_gemm.cpp``), built once per machine through ``pagoda.cpp_extension``.

A layer's GPTQ or AWQ tensors are unpacked once and repacked into the kernel's 16-column panels
(``CpuInt4Weight.prepare``); an act-order GPTQ layer's input channels are sorted by group on the
way, and each call permutes its activations the same way. The kernel widens the nibbles to float
in registers, up to 8 rows (AVX-512; 4 with AVX2) sharing each widened vector; past
``IN_REGISTER_MAX_ROWS`` rows (where a path's tiles are too small to win) it widens slabs of columns
to float32 instead and hands them to torch's float matmul.

The library picks its path at run time from the CPU's flags: AVX-512, AVX2 + FMA, or portable C++.
``PAGODA_INT4_KERNEL=0`` at load runs the torch reference instead; ``avx512|avx2|scalar`` forces one
path (read at each call).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension, SwitchedKernelLibrary

EXTENSION = CppExtension("pagoda_int4_gemm", "pagoda_quant_gptq_awq", ["csrc/int4_gemm.cpp"])
KERNEL_ENV = "PAGODA_INT4_KERNEL"
PATHS = {"auto": 0, "avx512": 1, "avx2": 2, "scalar": 3}
PANEL = 16
# Rows up to this (per path) run the in-register kernel; more rows the widened slabs + torch's float matmul.
# Measured with benchmarks/int4_matmul.py (docs/quantization.md, GPTQ / AWQ): the AVX-512 kernel's 8-row
# tiles beat the slabs at every row count tried (1 to 4096); AVX2's 4-row tiles up to about 64 rows; the
# portable path only at one row.
IN_REGISTER_MAX_ROWS: dict[str, int | None] = {"avx512": None, "avx2": 64, "scalar": 1}
# Floats one widened slab holds (16 MiB): bounds the extra memory of the many-rows path.
SLAB_FLOATS = 4 << 20

_KERNEL = SwitchedKernelLibrary(EXTENSION, KERNEL_ENV, PATHS, "pagoda_int4_paths")


def library() -> ModuleType | None:
    """The compiled library, or None where it cannot be built (``EXTENSION.build_failure()`` says why) or is off."""
    return _KERNEL.library()


def path_code() -> int:
    return _KERNEL.path_code()  # envs refuses a name outside 0 and PATHS


def paths() -> list[str]:
    """The library's paths this CPU runs, the one ``auto`` picks first."""
    return _KERNEL.paths()


def describe() -> str:
    return _KERNEL.describe("int4")


@dataclass
class CpuInt4Weight:
    """A 4-bit weight in the kernel's panels: [N/16][K][8] bytes, scale and scale x zero [N/16][G][16]."""

    packed: torch.Tensor
    scales: torch.Tensor
    szeros: torch.Tensor
    gstart: torch.Tensor  # int64 [G + 1]: group g is k in gstart[g] .. gstart[g + 1] (the kernel's k order)
    perm: torch.Tensor | None  # the kernel's k order as input channels (None: the checkpoint's order)
    in_features: int
    out_features: int

    @classmethod
    def prepare(cls, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
                lib: ModuleType) -> CpuInt4Weight:
        """``q`` [K, N] values 0..15, ``zeros`` / ``scales`` [G, N], ``groups`` [K] the group of each input channel."""
        k, n = q.shape
        g = scales.shape[0]
        groups = groups.long()
        if bool((groups[1:] >= groups[:-1]).all()):
            perm = None
        else:  # act order: the kernel reads each group as one run of k
            perm = torch.argsort(groups, stable=True)
            q, groups = q[perm], groups[perm]
        counts = torch.bincount(groups, minlength=g)
        gstart = torch.zeros(g + 1, dtype=torch.int64)
        gstart[1:] = torch.cumsum(counts, 0)
        panels = -(-n // PANEL)
        packed = torch.empty(panels * k * 8, dtype=torch.uint8)
        packed_scales = torch.empty(panels * g * PANEL, dtype=torch.float32)
        packed_szeros = torch.empty(panels * g * PANEL, dtype=torch.float32)
        q = q.to(torch.uint8).contiguous()
        lib.pagoda_int4_pack(q.data_ptr(), scales.float().contiguous().data_ptr(), zeros.float().contiguous().data_ptr(),
                             k, n, g, packed.data_ptr(), packed_scales.data_ptr(), packed_szeros.data_ptr())
        return cls(packed, packed_scales, packed_szeros, gstart, perm, k, n)

    @property
    def num_groups(self) -> int:
        return int(self.gstart.numel()) - 1

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, lib: ModuleType) -> torch.Tensor:
        """``x`` [M, K] -> float32 [M, N] (+ bias)."""
        xf = x.float()
        if self.perm is not None:
            xf = xf.index_select(1, self.perm)
        xf = xf.contiguous()
        b = None if bias is None else bias.float().contiguous()
        threads = torch.get_num_threads()
        limit = IN_REGISTER_MAX_ROWS.get(_KERNEL.path_name())
        if limit is None or xf.shape[0] <= limit:
            return self.in_register_matmul(xf, b, lib, threads)
        return self.slab_matmul(xf, b, lib, threads)

    def in_register_matmul(self, xf: torch.Tensor, b: torch.Tensor | None, lib: ModuleType,
                           threads: int) -> torch.Tensor:
        """The nibbles widened in registers, up to 4 rows sharing each (``xf``: float32, contiguous, kernel order)."""
        m = xf.shape[0]
        n, k = self.out_features, self.in_features
        y = torch.empty(m, n, dtype=torch.float32)
        _KERNEL.check(lib.pagoda_int4_gemm(path_code(), xf.data_ptr(), m, k, self.packed.data_ptr(),
                                           self.scales.data_ptr(), self.szeros.data_ptr(), self.gstart.data_ptr(),
                                           self.num_groups, None if b is None else b.data_ptr(), n, k, y.data_ptr(),
                                           threads))
        return y

    def slab_matmul(self, xf: torch.Tensor, b: torch.Tensor | None, lib: ModuleType, threads: int) -> torch.Tensor:
        """Slabs of columns widened to float32, each multiplied by torch's float matmul."""
        n, k = self.out_features, self.in_features
        width = max(PANEL, SLAB_FLOATS // max(k, 1) // PANEL * PANEL)
        if width >= n:
            return self._slab_matmul(xf, 0, n, b, lib, threads)
        return torch.cat([self._slab_matmul(xf, n0, min(n, n0 + width), None if b is None else b[n0:n0 + width],
                                            lib, threads) for n0 in range(0, n, width)], dim=1)

    def _slab_matmul(self, xf: torch.Tensor, n0: int, n1: int, bias: torch.Tensor | None, lib: ModuleType,
                     threads: int) -> torch.Tensor:
        k = self.in_features
        slab = torch.empty(k, n1 - n0, dtype=torch.float32)
        _KERNEL.check(lib.pagoda_int4_dequantize(path_code(), self.packed.data_ptr(), self.scales.data_ptr(),
                                                 self.szeros.data_ptr(), self.gstart.data_ptr(), self.num_groups,
                                                 self.out_features, k, n0, n1, slab.data_ptr(), threads))
        return torch.mm(xf, slab) if bias is None else torch.addmm(bias, xf, slab)

    def dequantized(self, lib: ModuleType) -> torch.Tensor:
        """The float32 weight [N, K] in the checkpoint's input order (tests)."""
        slab = torch.empty(self.in_features, self.out_features, dtype=torch.float32)
        _KERNEL.check(lib.pagoda_int4_dequantize(path_code(), self.packed.data_ptr(), self.scales.data_ptr(),
                                                 self.szeros.data_ptr(), self.gstart.data_ptr(), self.num_groups,
                                                 self.out_features, self.in_features, 0, self.out_features, slab.data_ptr(),
                                                 torch.get_num_threads()))
        if self.perm is not None:
            unsorted = torch.empty_like(slab)
            unsorted[self.perm] = slab
            slab = unsorted
        return slab.t().contiguous()
