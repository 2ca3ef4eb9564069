"""pagoda's CPU matmul: ``x @ W^T (+ b)`` from a weight packed once into 32-column panels (AVX-512).

A C++ kernel (``csrc/gemm.cpp``) built once per machine through ``pagoda.cpp_extension``:
float32 on AVX-512F, bfloat16 on AVX512_BF16 (``vdpbf16ps``). It beats both the GEMV and
oneDNN's packed matmul at every row count measured (figures in the source), so where the CPU
has it, it serves every linear layer of its dtypes alone, from one packed copy of each weight;
see ``pagoda_platform_cpu.platform`` for the choice and ``pagoda_platform_cpu.linear`` for the
paths other CPUs take.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension

EXTENSION_NAME = "pagoda_cpu_gemm"
SOURCE = "csrc/gemm.cpp"
_DECLARATIONS = """
#include <torch/extension.h>
#include <optional>
#include <string>
bool gemm_supports(std::string dtype);
torch::Tensor gemm_pack(torch::Tensor weight);
torch::Tensor gemm(torch::Tensor x, torch::Tensor packed, int64_t N, std::optional<torch::Tensor> bias);
"""
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_NEEDS = {torch.float32: "AVX-512F", torch.bfloat16: "AVX512_BF16 (with AVX512BW and AVX512VL)"}


def _sources() -> list[str]:
    return [_DECLARATIONS, resources.files("pagoda_platform_cpu").joinpath(SOURCE).read_text()]


EXTENSION = CppExtension(EXTENSION_NAME, _sources, ["gemm_supports", "gemm_pack", "gemm"])


def kernel() -> ModuleType:
    """The compiled extension; builds it on first use. Raises ExtensionBuildError when it cannot be built."""
    return EXTENSION.module()


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run ``dtype`` here (no build, no such instructions), or None."""
    if dtype not in _DTYPE_NAMES:
        return f"{dtype} is not covered (float32 and bfloat16 are)"
    failure = EXTENSION.build_failure()
    if failure is not None:
        return failure
    if not kernel().gemm_supports(_DTYPE_NAMES[dtype]):
        return f"this CPU has no {_NEEDS[dtype]}"
    return None


@dataclass(frozen=True)
class PackedWeight:
    packed: torch.Tensor  # [ceil(N/32), k-steps, 32, elements per k-step]
    out_features: int


class PackedGemmKernel:
    """A ``LinearKernel``: ``prepare`` packs the weight, ``apply`` multiplies; float32 and bfloat16."""

    name = "cpu_packed_gemm"

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> None:
        self._kernel = kernel()
        self.dtypes = dtypes

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes and weight.numel() > 0

    def prepare(self, weight: torch.Tensor) -> PackedWeight:
        return PackedWeight(self._kernel.gemm_pack(weight), weight.shape[0])

    def apply(self, x: torch.Tensor, prepared: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return self._kernel.gemm(x, prepared.packed, prepared.out_features, bias)
        rows = x.reshape(-1, x.shape[-1])
        return self._kernel.gemm(rows, prepared.packed, prepared.out_features, bias).reshape(*x.shape[:-1], -1)
