"""The 8-bit GPTQ CPU kernel (``csrc/int8_gemm.cpp``), built once per machine through ``pagoda.cpp_extension``.

A layer's GPTQ tensors are unpacked once and repacked into the kernel's 16-column panels of 4-k blocks
(``CpuInt8Weight.prepare``); an act-order layer's input channels are sorted by group on the way (as the
4-bit kernel does), and each call permutes its activations the same way. The kernel subtracts the zero
point in integers and widens the bytes to float in registers, up to 8 rows (AVX-512; 4 with AVX2)
sharing each widened vector; past ``IN_REGISTER_MAX_ROWS`` rows it widens slabs of columns to float32
instead and hands them to torch's float matmul.

The library picks its path at run time from the CPU's flags: with AVX512-VNNI, ``vnni512_int16`` (the
activations quantized to int16 per 32 inputs, multiplied with VNNI's word dot products: about twice the
float tiles' speed at a relative error of 2e-5, finer than float16 activations); else float activations
on AVX-512, AVX2 + FMA, or portable C++. ``PAGODA_GPTQ8_KERNEL=0`` at load runs the torch reference
instead; a path's name forces it (read at each call). ``vnni512`` (int8 activations, VNNI's byte dot
products) is faster still but about 0.5% off, enough to change a tiny model's greedy tokens
(docs/quantization.md): ``auto`` never picks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension, SwitchedKernelLibrary

EXTENSION = CppExtension("pagoda_gptq8_gemm", "pagoda_quant_gptq_awq", ["csrc/int8_gemm.cpp"])
KERNEL_ENV = "PAGODA_GPTQ8_KERNEL"
PATHS = {"auto": 0, "avx512": 1, "avx2": 2, "scalar": 3, "vnni512": 4, "vnni512_int16": 5}
PANEL = 16
BLOCK = 4  # k per stored block: every group starts on one
# Rows up to this (per path) run the in-register kernel; more rows the widened slabs + torch's float matmul.
# Measured on one thread (benchmarks/int8_gptq_matmul.py; docs/quantization.md, GPTQ 8-bit): the AVX-512 tiles
# (all three kinds) beat the slabs at 1 to 256 rows; AVX2's 4-row tiles up to 64 rows (0.42-0.63x the slab's time;
# 1.2-1.5x at 128 and 256); the portable tiles at no row count (4x the slab's time at one row).
IN_REGISTER_MAX_ROWS: dict[str, int | None] = {"vnni512_int16": None, "avx512": None, "vnni512": None, "avx2": 64,
                                               "scalar": 0}
# Floats one widened slab holds (16 MiB): bounds the extra memory of the many-rows path.
SLAB_FLOATS = 4 << 20

_KERNEL = SwitchedKernelLibrary(EXTENSION, KERNEL_ENV, PATHS, "pagoda_gptq8_paths")


def library() -> ModuleType | None:
    """The compiled library, or None where it cannot be built (``EXTENSION.build_failure()`` says why) or is off."""
    return _KERNEL.library()


def path_code() -> int:
    return _KERNEL.path_code()


def paths() -> list[str]:
    """The library's paths this CPU runs, the one ``auto`` picks first."""
    return _KERNEL.paths()


def describe() -> str:
    return _KERNEL.describe("GPTQ 8-bit")


@dataclass
class CpuInt8Weight:
    """An 8-bit weight in the kernel's panels: [N/16][Kp/4][16][4] bytes, scale and zero [N/16][G][16]."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor  # int32
    gstart: torch.Tensor  # int64 [G + 1]: group g is k in gstart[g] .. gstart[g + 1] (the kernel's k order)
    gpad: torch.Tensor  # int64 [G + 1]: where group g's k are stored (each group padded to whole blocks)
    perm: torch.Tensor | None  # the kernel's k order as input channels (None: the checkpoint's order)
    in_features: int
    out_features: int

    @classmethod
    def prepare(cls, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
                lib: ModuleType) -> CpuInt8Weight:
        """``q`` [K, N] values 0..255, ``zeros`` (integers) / ``scales`` [G, N], ``groups`` [K] the group of each input."""
        k, n = q.shape
        g = scales.shape[0]
        if not bool(torch.equal(zeros, zeros.round())):
            raise ValueError("GPTQ 8-bit kernel: zero points must be integers")
        groups = groups.long()
        if bool((groups[1:] >= groups[:-1]).all()):
            perm = None
        else:  # act order: the kernel reads each group as one run of k
            perm = torch.argsort(groups, stable=True)
            q, groups = q[perm], groups[perm]
        counts = torch.bincount(groups, minlength=g)
        gstart = torch.zeros(g + 1, dtype=torch.int64)
        gstart[1:] = torch.cumsum(counts, 0)
        gpad = torch.zeros(g + 1, dtype=torch.int64)
        gpad[1:] = torch.cumsum((counts + BLOCK - 1) // BLOCK * BLOCK, 0)
        panels = -(-n // PANEL)
        kp = int(gpad[-1])
        packed = torch.empty(panels * kp * PANEL, dtype=torch.uint8)
        packed_scales = torch.empty(panels * g * PANEL, dtype=torch.float32)
        packed_zeros = torch.empty(panels * g * PANEL, dtype=torch.int32)
        # held in names: a temporary's memory would be freed before the call reads it
        q = q.to(torch.uint8).contiguous()
        scales32 = scales.float().contiguous()
        zeros32 = zeros.to(torch.int32).contiguous()
        lib.pagoda_gptq8_pack(q.data_ptr(), scales32.data_ptr(), zeros32.data_ptr(), gstart.data_ptr(),
                              gpad.data_ptr(), k, n, g, packed.data_ptr(), packed_scales.data_ptr(),
                              packed_zeros.data_ptr())
        return cls(packed, packed_scales, packed_zeros, gstart, gpad, perm, k, n)

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
            return self.in_register_matmul(xf, b, lib, threads, path_code())
        return self.slab_matmul(xf, b, lib, threads)

    def in_register_matmul(self, xf: torch.Tensor, b: torch.Tensor | None, lib: ModuleType, threads: int,
                           path: int) -> torch.Tensor:
        """Bytes widened in registers, or int8 activations (``path`` 4); ``xf``: float32, contiguous, kernel order."""
        m = xf.shape[0]
        n, k = self.out_features, self.in_features
        y = torch.empty(m, n, dtype=torch.float32)
        _KERNEL.check(lib.pagoda_gptq8_gemm(path, xf.data_ptr(), m, k, self.packed.data_ptr(), self.scales.data_ptr(),
                                            self.zeros.data_ptr(), self.gstart.data_ptr(), self.gpad.data_ptr(),
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
        slab = self._widen(n0, n1, lib, threads)
        return torch.mm(xf, slab) if bias is None else torch.addmm(bias, xf, slab)

    def _widen(self, n0: int, n1: int, lib: ModuleType, threads: int) -> torch.Tensor:
        slab = torch.empty(self.in_features, n1 - n0, dtype=torch.float32)
        _KERNEL.check(lib.pagoda_gptq8_dequantize(path_code(), self.packed.data_ptr(), self.scales.data_ptr(),
                                                  self.zeros.data_ptr(), self.gstart.data_ptr(), self.gpad.data_ptr(),
                                                  self.num_groups, self.out_features, self.in_features, n0, n1,
                                                  slab.data_ptr(), threads))
        return slab

    def dequantized(self, lib: ModuleType) -> torch.Tensor:
        """The float32 weight [N, K] in the checkpoint's input order (tests)."""
        slab = self._widen(0, self.out_features, lib, torch.get_num_threads())
        if self.perm is not None:
            unsorted = torch.empty_like(slab)
            unsorted[self.perm] = slab
            slab = unsorted
        return slab.t().contiguous()
