"""The decode-sized matmul: ``x @ W^T (+ b)`` for a few rows of ``x``, read straight from the plain weight.

A C++ kernel (``csrc/gemv.cpp``) built once per machine through ``pagoda.cpp_extension``.
At a handful of rows a linear layer is a read of its weight; this kernel streams it at
the memory's speed (one forward pass per thread over its share of the rows), where oneDNN's
packed matmul reads at 60-80% of that. See ``pagoda_platform_cpu.linear`` for when it is used.
"""

from __future__ import annotations

from importlib import resources
from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension

EXTENSION_NAME = "pagoda_cpu_gemv"
SOURCE = "csrc/gemv.cpp"
_DECLARATIONS = """
#include <torch/extension.h>
#include <optional>
#include <string>
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
std::string gemv_isa();
"""


def source_text() -> str:
    return resources.files("pagoda_platform_cpu").joinpath(SOURCE).read_text()


def _sources() -> list[str]:
    return [_DECLARATIONS, source_text()]


EXTENSION = CppExtension(EXTENSION_NAME, _sources, ["gemv", "gemv_isa"])


def kernel() -> ModuleType:
    """The compiled extension; builds it on first use. Raises ExtensionBuildError when it cannot be built."""
    return EXTENSION.module()


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
