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

import ctypes

import torch

from pagoda.cpp_extension import CppExtension
from pagoda.layers import TORCH_LAYER_OPS

EXTENSION_NAME = "pagoda_cpu_layer_ops"
# -ffp-contract=off: no fused multiply-adds where torch rounds between the multiply and the add,
# so float32 results match TorchLayerOps op for op.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
EXTENSION = CppExtension(EXTENSION_NAME, "pagoda_platform_cpu", ["csrc/layer_ops.cpp"], cflags=_CFLAGS)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class LayerOpsLibrary:
    """The library's entry points with their C signatures, declared once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.add_rms_norm = library.pagoda_add_rms_norm
        self.add_rms_norm.argtypes = [_int, _p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _i64, _p, _p, ctypes.c_float, _int]
        self.add_rms_norm.restype = _int
        self.silu_and_mul = library.pagoda_silu_and_mul
        self.silu_and_mul.argtypes = [_int, _p, _i64, _i64, _i64, _p, _int]
        self.silu_and_mul.restype = _int
        self.rotary_neox = library.pagoda_rotary_neox
        self.rotary_neox.argtypes = [_int, _p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _i64, _i64, _int]
        self.rotary_neox.restype = _int


def _code(t: torch.Tensor) -> int | None:
    """The kernels' dtype code when ``t`` is a plain CPU tensor they cover (float32 or bf16, no autograd to record), else None."""
    code = _DTYPE_CODES.get(t.dtype)
    if code is None or not t.is_cpu or t.layout != torch.strided or (t.requires_grad and torch.is_grad_enabled()):
        return None
    return code


def _rows(t: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """[T, D] or [T, B, D] as (n0, n1, d, stride0, stride1) when its last dim is contiguous, else None."""
    if t.dim() == 2:
        n0, d = t.shape
        s0, s_last = t.stride()
        n1, s1 = 1, 0
    elif t.dim() == 3:
        n0, n1, d = t.shape
        s0, s1, s_last = t.stride()
    else:
        return None
    if d > 1 and s_last != 1:
        return None
    return n0, n1, d, s0, s1


class CpuLayerOps:
    """``pagoda.layers.LayerOps`` on the C++ kernels, falling back to torch for what they do not cover.

    Writes in place: ``add_rms_norm`` stores the sum into ``residual`` (and returns it as
    the sum); ``rotary_neox_`` rotates ``qk``. Nothing else is written.
    """

    name = "cpu_fused"

    def __init__(self, kernels: LayerOpsLibrary) -> None:
        self._k = kernels

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """rms_norm(x), or with a residual rms_norm(residual <- x + residual); None (nothing written) when not covered."""
        code = _code(x)
        rows = _rows(x)
        if code is None or rows is None or _code(weight) != code or weight.dim() != 1 or not weight.is_contiguous():
            return None
        n0, n1, d, s0, s1 = rows
        if weight.shape[0] != d:
            return None
        r0 = r1 = 0
        if residual is not None:
            res_rows = _rows(residual)
            if _code(residual) != code or res_rows is None or residual.shape != x.shape:
                return None
            r0, r1 = res_rows[3], res_rows[4]
        out = torch.empty(x.shape, dtype=x.dtype)
        done = self._k.add_rms_norm(
            code, x.data_ptr(), n0, n1, d, s0, s1, None if residual is None else residual.data_ptr(), r0, r1,
            weight.data_ptr(), out.data_ptr(), eps, torch.get_num_threads(),
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
        code = _code(gate_up)
        if code is not None and gate_up.dim() == 2:
            rows, width = gate_up.shape
            s0, s1 = gate_up.stride()
            if width % 2 == 0 and s1 == 1:
                out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
                if self._k.silu_and_mul(code, gate_up.data_ptr(), rows, width // 2, s0, out.data_ptr(), torch.get_num_threads()):
                    return out
        return TORCH_LAYER_OPS.silu_and_mul(gate_up)

    def rotary_neox_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if not self._rotary(qk, cos, sin):
            TORCH_LAYER_OPS.rotary_neox_(qk, cos, sin)

    def _rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotates qk [T, heads, head_dim] in place with cos/sin [T, 1, rot / 2]; False (nothing written) when not covered."""
        code = _code(qk)
        if code is None or qk.dim() != 3 or _code(cos) != code or _code(sin) != code:
            return False
        if cos.dim() != 3 or sin.dim() != 3:
            return False
        tokens, heads, head_dim = qk.shape
        c_tokens, c_one, half = cos.shape
        if c_one != 1 or sin.shape != cos.shape or c_tokens != tokens:
            return False
        q0, q1, q2 = qk.stride()
        c0, _, c2 = cos.stride()
        s0, _, s2 = sin.stride()
        if (head_dim > 1 and q2 != 1) or (half > 1 and (c2 != 1 or s2 != 1)):
            return False
        return bool(
            self._k.rotary_neox(
                code, qk.data_ptr(), tokens, heads, head_dim, q0, q1, cos.data_ptr(), c0, sin.data_ptr(), s0, half,
                torch.get_num_threads(),
            )
        )


_ops: CpuLayerOps | None = None


def cpu_layer_ops() -> CpuLayerOps:
    """The fused ops; builds the kernels (or waits for their build) on first use. Raises ExtensionBuildError when they cannot be built."""
    global _ops
    if _ops is None:
        _ops = CpuLayerOps(LayerOpsLibrary(EXTENSION.library()))
    return _ops
