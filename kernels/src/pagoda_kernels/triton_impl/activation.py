"""Triton SiLU-and-mul: programs over (row, column block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels.dispatch import interpret_mode, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = min(next_power_of_2(d), 64 if interpret_mode() else 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block)
    return out.view(*x.shape[:-1], d)
