"""The LoRA wrapper of core's linear layers: ``max_loras`` fixed adapter slots per layer.

``pagoda.layers.Linear`` (so every parallel subclass, so every family built on them) calls its
``lora`` right after its own matmul and before any activation it applies: ``y = base(x) + lora(x)``.
A quantized layer's adapter runs the same way, in float beside the quantized matmul.

A layer's slots are two preallocated tensors (``LoRAKernel``'s layout): ``lora_a`` [max_loras * R, in]
and ``lora_b`` [max_loras * R, out], ``R = max_lora_rank x slices``. A packed layer (q/k/v in
``qkv_proj``, gate/up in ``gate_up_proj``) gives each stacked projection its own rank block and its
columns of B (B is block-diagonal in a slot): one shrink serves all its projections, each with its own A,
and the kernel expands each projection's rank block against its own columns only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.lora.punica import TORCH_LORA_KERNEL, LoRAKernel, LoRAStepMapping


@dataclass(slots=True)
class LoRAStepState:
    """What every wrapped layer of one model reads in a step: the token -> slot mapping and the kernel."""

    kernel: LoRAKernel = field(default_factory=lambda: TORCH_LORA_KERNEL)
    # None: no token of this step has an adapter (the layers add nothing)
    mapping: LoRAStepMapping | None = None


class LoRASlots:
    """One linear layer's adapter slots."""

    def __init__(self, name: str, in_features: int, slice_widths: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoRAStepState,
                 checkpoint_shape: tuple[int, list[int]] | None = None) -> None:
        """``in_features`` / ``slice_widths``: this rank's; ``checkpoint_shape``: (inputs, stacked widths) of
        the whole layer, which an adapter's factors must fit (None: the same, no tensor parallelism)."""
        self.name = name
        self.in_features = in_features
        self.slice_widths = tuple(slice_widths)
        whole_in, whole_widths = checkpoint_shape or (in_features, slice_widths)
        self.checkpoint_in_features = whole_in
        self.checkpoint_widths = tuple(whole_widths)
        self.slice_offsets = [sum(slice_widths[:i]) for i in range(len(slice_widths))]
        self.out_features = sum(slice_widths)
        self.max_rank = max_rank
        self.block = max_rank * len(slice_widths)  # rows of A (and of B) one slot holds
        self.lora_a = torch.zeros(max_loras * self.block, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras * self.block, self.out_features, dtype=dtype, device=device)
        self.state = state

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mapping = self.state.mapping
        if mapping is None:
            return y
        return self.state.kernel.add_lora_linear(y, x, self.lora_a, self.lora_b, mapping,
                                                 self.slice_widths if len(self.slice_widths) > 1 else None)

    def clear_slot(self, slot: int) -> None:
        rows = slice(slot * self.block, (slot + 1) * self.block)
        self.lora_a[rows].zero_()
        self.lora_b[rows].zero_()

    def write(self, slot: int, index: int | None, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Stacked projection ``index``'s factors (None: a layer of one projection) into ``slot``.

        ``a`` [r, in], ``b`` [rows, r], this rank's part; the caller checked the whole factors (``check``) and
        split an adapter over a fused checkpoint layer into its projections (``split_fused``).
        """
        r = a.shape[0]
        first = slot * self.block + (index or 0) * self.max_rank
        self.lora_a[first:first + r].copy_(a)
        offset = 0 if index is None else self.slice_offsets[index]
        self.lora_b[first:first + r, offset:offset + b.shape[0]].copy_((b.to(torch.float32) * scaling).t())

    def split_fused(self, index: int | None, a: torch.Tensor,
                    b: torch.Tensor) -> list[tuple[int | None, torch.Tensor, torch.Tensor]]:
        """An adapter over the whole of a layer that stacks projections (GPT-2's fused ``c_attn``) as one
        adapter per projection: A repeated in every projection's rank block and B split by rows keep B
        block-diagonal, which the kernel's expand relies on."""
        if index is not None or len(self.checkpoint_widths) == 1:
            return [(index, a, b)]
        return [(i, a, part) for i, part in enumerate(b.split(list(self.checkpoint_widths), dim=0))]

    def check(self, index: int | None, a: torch.Tensor, b: torch.Tensor) -> str | None:
        """Why factors ``a``, ``b`` do not fit projection ``index`` of this layer (None: they fit)."""
        rows = sum(self.checkpoint_widths) if index is None else self.checkpoint_widths[index]
        if a.shape[1] != self.checkpoint_in_features or b.shape[0] != rows:
            what = "" if index is None else f" (stacked projection {index})"
            return (f"module {self.name}{what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                    f"layer's {self.checkpoint_in_features} inputs and {rows} outputs")
        if a.shape[0] > self.max_rank:
            return f"module {self.name}: rank {a.shape[0]} is larger than max_lora_rank={self.max_rank}"
        return None
