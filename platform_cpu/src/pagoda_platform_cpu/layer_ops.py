"""Fused elementwise decoder-layer ops (RMSNorm, add + RMSNorm, SiLU-and-mul, RoPE) as C++ kernels.

A single-stream decode step of a small model spent milliseconds in ~25 separate
torch calls per layer, each a few microseconds of dispatch for a few hundred
elements; the kernels in ``csrc/layer_ops.cpp`` make that four calls per layer.
They cover float32 and bfloat16 CPU tensors in the layouts the decoder uses (rows
with a contiguous last dim, q/k as strided views of the fused QKV output); every
other case goes to ``TorchLayerOps``, whose numerics the kernels follow (see the
C++ file for where they may differ by float32 ulps).

Rows are split over threads only for calls of 32K+ elements (prefill, decode
batches of ~60+ sequences for a 576-wide model); below that, waking the OpenMP
pool costs more than it saves, and a single-stream decode step never pays it.
"""

from __future__ import annotations

from importlib import resources
from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension
from pagoda.layers import TORCH_LAYER_OPS

EXTENSION_NAME = "pagoda_cpu_layer_ops"
_DECLARATIONS = """
#include <torch/extension.h>
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
bool rotary_neox(torch::Tensor qk, torch::Tensor cos, torch::Tensor sin);
"""
# -ffp-contract=off: no fused multiply-adds where torch rounds between the multiply and the add,
# so float32 results match TorchLayerOps op for op.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")


def _sources() -> list[str]:
    return [_DECLARATIONS, resources.files("pagoda_platform_cpu").joinpath("csrc", "layer_ops.cpp").read_text()]


EXTENSION = CppExtension(EXTENSION_NAME, _sources, ["rms_norm", "add_rms_norm", "silu_and_mul", "rotary_neox"], cflags=_CFLAGS)


class CpuLayerOps:
    """``pagoda.layers.LayerOps`` on the C++ kernels, falling back to torch for what they do not cover.

    Writes in place: ``add_rms_norm`` stores the sum into ``residual`` (and returns it as
    the sum); ``rotary_neox_`` rotates ``qk``. Nothing else is written.
    """

    name = "cpu_fused"

    def __init__(self, kernels: ModuleType) -> None:
        self._k = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = self._k.rms_norm(x, weight, eps)
        return TORCH_LAYER_OPS.rms_norm(x, weight, eps) if out is None else out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        normed = self._k.add_rms_norm(x, residual, weight, eps)
        if normed is None:
            return TORCH_LAYER_OPS.add_rms_norm(x, residual, weight, eps)
        return normed, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = self._k.silu_and_mul(gate_up)
        return TORCH_LAYER_OPS.silu_and_mul(gate_up) if out is None else out

    def rotary_neox_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if not self._k.rotary_neox(qk, cos, sin):
            TORCH_LAYER_OPS.rotary_neox_(qk, cos, sin)


def cpu_layer_ops() -> CpuLayerOps:
    """The fused ops; builds the kernels on first use. Raises ExtensionBuildError when they cannot be built."""
    return CpuLayerOps(EXTENSION.module())
