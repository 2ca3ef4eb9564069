"""Triton RMSNorm with an optional fused residual add: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels.dispatch import next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
    stride_x, stride_residual, stride_out, stride_summed,
    hidden, eps,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activation dtype first, as the unfused add would.
        summed = (x + r).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * stride_summed + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        summed = torch.empty_like(x2)
    else:
        r2 = summed = x2  # unused when ADD_RESIDUAL is False
    if rows:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, summed,
            x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0),
            hidden, eps,
            BLOCK=block, ADD_RESIDUAL=residual is not None, num_warps=min(max(block // 256, 1), 16),
        )
    return out.view(x.shape), (summed.view(x.shape) if residual is not None else None)
