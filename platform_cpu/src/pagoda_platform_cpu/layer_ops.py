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

from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension
from pagoda.layers import TORCH_LAYER_OPS

EXTENSION_NAME = "pagoda_cpu_layer_ops"
# -ffp-contract=off: no fused multiply-adds where torch rounds between the multiply and the add,
# so float32 results match TorchLayerOps op for op.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
EXTENSION = CppExtension(EXTENSION_NAME, "pagoda_platform_cpu", ["csrc/layer_ops.cpp"], cflags=_CFLAGS)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class LayerOpsLibrary:
    """The library's entry points."""

    def __init__(self, library: ModuleType) -> None:
        self.add_rms_norm = library.pagoda_add_rms_norm
        self.silu_and_mul = library.pagoda_silu_and_mul
        self.rotary_neox = library.pagoda_rotary_neox


_STRIDED = torch.strided
_is_grad_enabled = torch.is_grad_enabled
_num_threads = torch.get_num_threads
_empty = torch.empty
_empty_like = torch.empty_like


# The wrappers run on every call of a decode step (~120 per step for a 30-layer model), where a
# tensor attribute read costs ~0.1 us and a Python call or generator more: each reads what it
# needs once, inline, and checks autograd (rarely on) through is_grad_enabled first.


def _rows(t: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """[T, D] or [T, B, D] as (n0, n1, d, stride0, stride1) when its last dim is contiguous, else None."""
    strides = t.stride()
    if len(strides) == 2:
        n0, d = t.shape
        s0, s_last = strides
        n1, s1 = 1, 0
    elif len(strides) == 3:
        n0, n1, d = t.shape
        s0, s1, s_last = strides
    else:
        return None
    if s_last != 1 and d > 1:
        return None
    return n0, n1, d, s0, s1


class CpuLayerOps:
    """``pagoda.layers.LayerOps`` on the C++ kernels, falling back to torch for what they do not cover.

    Writes in place: ``add_rms_norm`` stores the sum into ``residual`` (and returns it as
    the sum); ``rotary_neox_`` rotates ``qk``. Nothing else is written.
    """

    name = "cpu_fused"

    def __init__(self, kernels: LayerOpsLibrary) -> None:
        self._add_rms_norm = kernels.add_rms_norm
        self._silu_and_mul = kernels.silu_and_mul
        self._rotary_neox = kernels.rotary_neox

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """rms_norm(x), or with a residual rms_norm(residual <- x + residual); None (nothing written) when not covered."""
        dtype = x.dtype
        code = _DTYPE_CODES.get(dtype)
        if (
            code is None
            or weight.dtype is not dtype
            or not (x.is_cpu and weight.is_cpu)
            or x.layout is not _STRIDED
            or weight.layout is not _STRIDED
        ):
            return None
        rows = _rows(x)
        if rows is None or weight.dim() != 1 or not weight.is_contiguous():
            return None
        n0, n1, d, s0, s1 = rows
        if weight.shape[0] != d:
            return None
        if residual is None:
            r0 = r1 = 0
            residual_ptr = None
            if _is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return None
        else:
            if residual.dtype is not dtype or not residual.is_cpu or residual.layout is not _STRIDED:
                return None
            res_rows = _rows(residual)
            if res_rows is None or res_rows[0] != n0 or res_rows[1] != n1 or res_rows[2] != d:
                return None
            if _is_grad_enabled() and (x.requires_grad or weight.requires_grad or residual.requires_grad):
                return None
            r0, r1 = res_rows[3], res_rows[4]
            residual_ptr = residual.data_ptr()
        # A contiguous x: empty_like is contiguous too, and the quickest allocation from Python.
        out = _empty_like(x) if (s0 == n1 * d and (s1 == d or n1 == 1)) else _empty(*x.shape, dtype=dtype)
        done = self._add_rms_norm(
            code, x.data_ptr(), n0, n1, d, s0, s1, residual_ptr, r0, r1, weight.data_ptr(), out.data_ptr(), eps,
            _num_threads(),
        )
        return out if done else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = self._norm(x, None, weight, eps)
        return TORCH_LAYER_OPS.rms_norm(x, weight, eps) if out is None else out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        normed = self._norm(x, residual, weight, eps)
        if normed is None:
            return TORCH_LAYER_OPS.add_rms_norm(x, residual, weight, eps)
        return normed, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        dtype = gate_up.dtype
        code = _DTYPE_CODES.get(dtype)
        if code is not None and gate_up.is_cpu and gate_up.layout is _STRIDED:
            strides = gate_up.stride()
            if len(strides) == 2 and strides[1] == 1 and not (_is_grad_enabled() and gate_up.requires_grad):
                rows, width = gate_up.shape
                if width % 2 == 0:
                    out = _empty(rows, width // 2, dtype=dtype)
                    if self._silu_and_mul(code, gate_up.data_ptr(), rows, width // 2, strides[0], out.data_ptr(), _num_threads()):
                        return out
        return TORCH_LAYER_OPS.silu_and_mul(gate_up)

    def rotary_neox_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if not self._rotary(qk, cos, sin):
            TORCH_LAYER_OPS.rotary_neox_(qk, cos, sin)

    def _rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotates qk [T, heads, head_dim] in place with cos/sin [T, 1, rot / 2]; False (nothing written) when not covered."""
        dtype = qk.dtype
        code = _DTYPE_CODES.get(dtype)
        if code is None or cos.dtype is not dtype or sin.dtype is not dtype:
            return False
        if not (qk.is_cpu and cos.is_cpu and sin.is_cpu) or qk.layout is not _STRIDED or cos.layout is not _STRIDED:
            return False
        if sin.layout is not _STRIDED:
            return False
        q_strides, c_strides, s_strides = qk.stride(), cos.stride(), sin.stride()
        if len(q_strides) != 3 or len(c_strides) != 3 or len(s_strides) != 3:
            return False
        tokens, heads, head_dim = qk.shape
        c_tokens, c_one, half = cos.shape
        if c_one != 1 or c_tokens != tokens or sin.shape != cos.shape:
            return False
        if (q_strides[2] != 1 and head_dim > 1) or (half > 1 and (c_strides[2] != 1 or s_strides[2] != 1)):
            return False
        if _is_grad_enabled() and (qk.requires_grad or cos.requires_grad or sin.requires_grad):
            return False
        return bool(
            self._rotary_neox(
                code, qk.data_ptr(), tokens, heads, head_dim, q_strides[0], q_strides[1], cos.data_ptr(), c_strides[0],
                sin.data_ptr(), s_strides[0], half, _num_threads(),
            )
        )


_ops: CpuLayerOps | None = None


def cpu_layer_ops() -> CpuLayerOps:
    """The fused ops; builds the kernels (or waits for their build) on first use. Raises ExtensionBuildError when they cannot be built."""
    global _ops
    if _ops is None:
        _ops = CpuLayerOps(LayerOpsLibrary(EXTENSION.library()))
    return _ops
