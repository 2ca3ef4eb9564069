"""The int8 CPU kernels (``csrc/int8_gemm.cpp``), built once per machine through ``pagoda.cpp_extension``,
the Triton kernels CUDA / ROCm run (``triton_kernels``, chosen by ``triton_path``), and the plain-torch
references every other platform (and a CPU without the library) runs.

The library picks its path at run time from the CPU's flags (``paths()``): AVX512_VNNI, AVX512BW,
AVX2, or portable C++. ``PAGODA_INT8_KERNEL=0`` forces the torch reference (A/B measurements);
``PAGODA_INT8_KERNEL=vnni512|avx512bw|avx2|scalar`` forces one path of the library.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pagoda import envs
from pagoda.cpp_extension import CppExtension, SwitchedKernelLibrary
from pagoda_quant_compressed_tensors import triton_path

EXTENSION = CppExtension("pagoda_int8_gemm", "pagoda_quant_compressed_tensors", ["csrc/int8_gemm.cpp"])
KERNEL_ENV = "PAGODA_INT8_KERNEL"
PATHS = {"auto": 0, "vnni512": 1, "avx512bw": 2, "avx2": 3, "scalar": 4}
PANEL = 16

_KERNEL = SwitchedKernelLibrary(EXTENSION, KERNEL_ENV, PATHS, "pagoda_int8_paths")


def library() -> ModuleType | None:
    """The compiled library, or None where it cannot be built (``EXTENSION.build_failure()`` says why) or is turned off."""
    return _KERNEL.library()


def path_code() -> int:
    return _KERNEL.path_code()  # envs refuses a name outside 0 and PATHS


def paths() -> list[str]:
    """The library's paths this CPU runs, the one ``auto`` picks first."""
    return _KERNEL.paths()


def describe() -> str:
    triton = "; Triton on CUDA/ROCm" if triton_path.triton_available() and envs.PAGODA_INT8_KERNEL != "0" else ""
    return _KERNEL.describe("int8") + triton


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference dynamic symmetric per-row int8 quantization: scale = max|x| / 127 (vLLM's), q = round(x / scale)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(x / torch.where(scale > 0, scale, 1.0)), 0.0).clamp_(-127, 127)
    return q.to(torch.int8), scale


@dataclass
class W8A8Weight:
    """An int8 weight [N, K] with per-output-channel float32 scales [N], and its packed form (None: torch path)."""

    weight: torch.Tensor
    scale: torch.Tensor
    packed: torch.Tensor | None = None
    colsum: torch.Tensor | None = None

    @classmethod
    def prepare(cls, weight: torch.Tensor, scale: torch.Tensor, on_cpu: bool) -> W8A8Weight:
        out = cls(weight.contiguous(), scale.float().contiguous())
        lib = library() if on_cpu and not triton_path.asked_on_cpu() else None
        if lib is not None:
            n, k = weight.shape
            panels, kp = -(-n // PANEL), -(-k // 4) * 4
            out.packed = torch.empty(panels * kp * PANEL, dtype=torch.int8)
            out.colsum = torch.empty(panels * PANEL, dtype=torch.int32)
            lib.pagoda_int8_pack_w8a8(out.weight.data_ptr(), n, k, out.packed.data_ptr(), out.colsum.data_ptr())
            out.weight = torch.empty(0, dtype=torch.int8)  # the packed copy is all the kernel reads
        return out

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [M, K] -> float32 [M, N]: activations quantized per row, int8 x int8 in int32, rescaled."""
        lib = library()
        if self.packed is None and triton_path.supports(x):
            from pagoda_quant_compressed_tensors import triton_kernels

            return triton_kernels.w8a8_matmul(x, self.weight, self.scale, bias)
        if self.packed is None or lib is None:
            q, xs = quantize_per_token(x)
            # the reference: exact int products (each |q w| <= 127^2, sums < 2^24 for K < 1040) in float
            y = torch.mm(q.float(), self.weight.float().t()) * xs * self.scale
            return y if bias is None else y + bias.float()
        m, k = x.shape
        n = self.scale.numel()
        xf = x.float().contiguous()
        kp = -(-k // 4) * 4
        q = torch.empty(m * kp, dtype=torch.int8)
        xs = torch.empty(m, dtype=torch.float32)
        threads = torch.get_num_threads()
        lib.pagoda_int8_quantize_rows(xf.data_ptr(), m, k, k, q.data_ptr(), xs.data_ptr(), threads)
        y = torch.empty(m, n, dtype=torch.float32)
        b = None if bias is None else bias.float().contiguous()
        assert self.colsum is not None
        ran = lib.pagoda_int8_gemm_w8a8(path_code(), q.data_ptr(), xs.data_ptr(), m, self.packed.data_ptr(),
                                        self.colsum.data_ptr(), self.scale.data_ptr(),
                                        None if b is None else b.data_ptr(), n, k, y.data_ptr(), threads)
        _KERNEL.check(ran)
        return y


@dataclass
class W8A16Weight:
    """An int8 weight [N, K] with float32 scales [N, G] (G = 1 per channel, else groups of K / G), packed for the kernel."""

    weight: torch.Tensor
    scale: torch.Tensor
    group_size: int
    packed: torch.Tensor | None = None
    packed_scale: torch.Tensor | None = None

    @classmethod
    def prepare(cls, weight: torch.Tensor, scale: torch.Tensor, group_size: int, on_cpu: bool) -> W8A16Weight:
        out = cls(weight.contiguous(), scale.float().contiguous(), group_size)
        lib = library() if on_cpu and not triton_path.asked_on_cpu() else None
        if lib is not None:
            n, k = weight.shape
            groups = out.scale.shape[1]
            panels = -(-n // PANEL)
            out.packed = torch.empty(panels * k * PANEL, dtype=torch.int8)
            out.packed_scale = torch.empty(panels * groups * PANEL, dtype=torch.float32)
            lib.pagoda_int8_pack_w8a16(out.weight.data_ptr(), out.scale.data_ptr(), n, k, groups,
                                       out.packed.data_ptr(), out.packed_scale.data_ptr())
            out.weight = torch.empty(0, dtype=torch.int8)
        return out

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K] (reference path and tests)."""
        scale = self.scale.repeat_interleave(self.group_size, dim=1)[:, : self.weight.shape[1]]
        return (self.weight.float() * scale).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lib = library()
        if self.packed is None and triton_path.supports(x):
            from pagoda_quant_compressed_tensors import triton_kernels

            return triton_kernels.w8a16_matmul(x, self.weight, self.scale, self.group_size, bias)
        if self.packed is None or lib is None:
            return F.linear(x.float(), self.dequantized(torch.float32), None if bias is None else bias.float())
        m, k = x.shape
        n = self.scale.shape[0]
        xf = x.float().contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        b = None if bias is None else bias.float().contiguous()
        assert self.packed_scale is not None
        ran = lib.pagoda_int8_gemm_w8a16(path_code(), xf.data_ptr(), m, k, self.packed.data_ptr(),
                                         self.packed_scale.data_ptr(), None if b is None else b.data_ptr(), n, k,
                                         self.group_size, y.data_ptr(), torch.get_num_threads())
        _KERNEL.check(ran)
        return y
