"""RMSNorm, alone and fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch

from pagoda_kernels.dispatch import Impl, use_triton


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [hidden={x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_norm_args(x, weight)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``residual' = x + residual`` (rounded to x's dtype), ``out = rms_norm(residual')``."""
    _check_norm_args(x, weight, residual)
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_torch(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: Impl = "auto") -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in fp32, returned in x's dtype."""
    if not use_triton(x.device, impl):
        return rms_norm_torch(x, weight, eps)
    from pagoda_kernels.triton_impl.norm import rms_norm_triton

    _check_norm_args(x, weight)
    return rms_norm_triton(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): one pass that adds the residual and normalises the sum."""
    if not use_triton(x.device, impl):
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    from pagoda_kernels.triton_impl.norm import rms_norm_triton

    _check_norm_args(x, weight, residual)
    out, summed = rms_norm_triton(x, residual, weight, eps)
    assert summed is not None
    return out, summed
