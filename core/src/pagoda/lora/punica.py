"""Batched LoRA for one step: each token's adapter slot, and the shrink/expand kernel that applies it.

The punica scheme (vLLM's ``PunicaWrapper``): ``y += (x · Aᵀ[slot]) · Bᵀ[slot]`` per token, the
scaling folded into B when the adapter enters its slot. The adapters live in ``max_loras`` fixed
slots (``pagoda.lora.layers.LoRASlots``), so the kernel's inputs have fixed shapes and a token's
slot is plain data: a ``[T]`` index tensor built with the batch.

``LoRAKernel`` is the interface a platform replaces (``Platform.lora_kernel``). ``TorchLoRAKernel``,
the default and this session's first step, is vectorised torch: it shrinks every token's row against
every slot's A at once (one GEMM, inner width ``max_loras x rank``), zeroes the slots that are not the
token's (a one-hot mask shared by all layers of the step), and expands with every slot's B (one
GEMM). Two GEMMs and a multiply per layer whatever the mix of adapters, no per-adapter loop; the
price is work proportional to ``max_loras`` rather than to one rank. Rows with no adapter are left
out of both GEMMs (and a step with no adapter at all skips them), so the base model pays only the
index. Grouped SGMV-style kernels (C++ with AVX-512/AVX2 paths, Triton) are the later goal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(slots=True)
class LoRAStepMapping:
    """Which tokens of the step run which slot, on the model's device (built once per step)."""

    # [T'] the rows of the flat batch that have an adapter; None: every row has one
    rows: torch.Tensor | None
    # [T', max_loras] one-hot of each such row's slot, in the adapters' dtype
    slot_mask: torch.Tensor


@runtime_checkable
class LoRAKernel(Protocol):
    """How one platform adds the slots' adapters to a linear layer's output."""

    name: str

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        mapping: LoRAStepMapping) -> torch.Tensor:
        """``y`` [T, out] plus each mapped row's ``(x · A[slot]ᵀ) · B[slot]``; returns the sum (may be ``y``).

        ``lora_a``: [max_loras * R, in] (slot s holds rows s*R .. s*R+R-1, zero past the adapter's rank);
        ``lora_b``: [max_loras * R, out] (B transposed, scaled). ``x`` [T, in] in the model dtype.
        """
        ...


class TorchLoRAKernel:
    """The vectorised torch kernel (see the module docstring)."""

    name = "torch"

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        mapping: LoRAStepMapping) -> torch.Tensor:
        rows = mapping.rows
        xs = x if rows is None else x.index_select(0, rows)
        shrunk = xs.to(lora_a.dtype) @ lora_a.t()  # [T', L*R]
        num_slots = mapping.slot_mask.shape[1]
        shrunk = (shrunk.view(len(xs), num_slots, -1) * mapping.slot_mask.unsqueeze(-1)).view(len(xs), -1)
        delta = (shrunk @ lora_b).to(y.dtype)  # [T', out]
        if rows is None:
            return y.add_(delta) if not y.requires_grad else y + delta
        return y.index_add_(0, rows, delta)


TORCH_LORA_KERNEL = TorchLoRAKernel()


def build_step_mapping(token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype,
                       device: torch.device) -> LoRAStepMapping | None:
    """The mapping for ``token_slots`` ([T] int64 on the host, -1 = no adapter); None when no row has one."""
    has = token_slots >= 0
    count = int(has.sum())
    if count == 0:
        return None
    rows = None if count == len(token_slots) else torch.nonzero(has).squeeze(1)
    slots = token_slots if rows is None else token_slots[rows]
    mask = torch.zeros(len(slots), num_slots, dtype=dtype)
    mask[torch.arange(len(slots)), slots] = 1
    return LoRAStepMapping(rows=None if rows is None else rows.to(device, non_blocking=True),
                           slot_mask=mask.to(device, non_blocking=True))
