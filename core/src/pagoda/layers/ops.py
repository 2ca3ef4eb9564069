"""The elementwise work of a decoder layer, implemented once per platform.

Model code does not call torch for RMSNorm, SiLU-and-mul or RoPE directly: it
calls ``self.ops`` on a ``LayerOpsModule`` (vLLM's ``CustomOp`` idea). Every such
module starts with ``TorchLayerOps``, the reference math; after loading, the
model runner asks the platform for its ``LayerOps`` (``Platform.layer_ops``) and
``bind_layer_ops`` installs it on every module. A platform's implementation may
take only the cases it has kernels for and hand the rest to ``TorchLayerOps``.

On CPU a decode step of a small model spends milliseconds in these ops as ~25
separate torch calls per layer (each a few microseconds of dispatch for a few
hundred elements); fused kernels make them four calls.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class LayerOps(Protocol):
    """Elementwise decoder-layer ops. Tensors are on one device, in the model dtype."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of ``x`` ([T, D] or [T, heads, D], rows possibly strided); a new tensor."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum rounded to ``x``'s dtype; with no residual the sum is ``x``.

        An implementation may write the sum into ``residual`` and return that tensor as the
        sum; it never writes ``x``. Callers hand over a residual nothing else reads.
        """
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] (gate then up) -> silu(gate) * up, [T, I]; a new tensor."""
        ...

    def rotary_neox_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE in place on ``qk`` [T, heads, head_dim], possibly a strided view.

        ``cos``/``sin`` are [T, 1, rot // 2]; only the first ``rot`` channels of each head
        rotate (``rot < head_dim``: partial rotary), pairing channel i with i + rot // 2.
        """
        ...


class TorchLayerOps:
    """The reference: plain torch ops, on any device and dtype."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            # torch's fused rms_norm: ~3x faster on CPU than the unfused ops at prefill sizes
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # Low precision: normalise in float32, round to the model dtype, then scale by the
        # weight in that dtype -- the order transformers uses, so bf16 results round alike.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x if residual is None else x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_neox_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        half = cos.shape[-1]
        x1 = qk[..., :half]
        x2 = qk[..., half : 2 * half]
        rotated_first = x1 * cos - x2 * sin
        rotated_second = x2 * cos + x1 * sin
        x1.copy_(rotated_first)
        x2.copy_(rotated_second)


TORCH_LAYER_OPS = TorchLayerOps()


class LayerOpsModule(nn.Module):
    """A module whose elementwise compute goes through ``self.ops`` (torch until a platform binds its own)."""

    # A class attribute, not a submodule: binding sets an instance attribute, nothing lands in the state dict.
    ops: LayerOps = TORCH_LAYER_OPS


def bind_layer_ops(model: nn.Module, ops: LayerOps) -> int:
    """Make every ``LayerOpsModule`` in ``model`` use ``ops``; returns how many there are."""
    count = 0
    for module in model.modules():
        if isinstance(module, LayerOpsModule):
            module.ops = ops
            count += 1
    return count
