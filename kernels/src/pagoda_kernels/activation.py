"""SiLU-and-mul: the gated activation of a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda_kernels.dispatch import Impl, use_triton


def _check_activation_args(x: torch.Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim ([..., 2 * d]: gate then up), got {tuple(x.shape)}")


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    _check_activation_args(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x of shape [..., 2 * d]."""
    if not use_triton(x.device, impl):
        return silu_and_mul_torch(x)
    from pagoda_kernels.triton_impl.activation import silu_and_mul_triton

    _check_activation_args(x)
    return silu_and_mul_triton(x)
