"""Batched LoRA for one step: each token's adapter slot, and the shrink/expand kernel that applies it.

The punica scheme (vLLM's ``PunicaWrapper``): ``y += (x · Aᵀ[slot]) · Bᵀ[slot]`` per token, the
scaling folded into B when the adapter enters its slot. The adapters live in ``max_loras`` fixed
slots (``pagoda.lora.layers.LoRASlots``), so the kernel's inputs have fixed shapes and a token's
slot is plain data: a ``[T]`` index tensor built with the batch.

``LoRAKernel`` is the interface a platform replaces (``Platform.lora_kernel``). ``TorchLoRAKernel``,
the default, is the SGMV scheme in torch: ``build_step_mapping`` sorts the step's adapted tokens by
slot once per step (every layer sees the same token -> slot map) and each layer shrinks and expands
every used slot's contiguous segment against that slot's factors only, each stacked projection's
slice of B against its own rank block only (a packed layer's B is block-diagonal: the zeros are never
multiplied). Rows with no adapter are in no segment, and a step with no adapter at all skips the
kernel, so the base model pays only the index. Two plans, chosen once per step on the host:
``batched`` pads the segments to one length and runs each stage as one ``bmm`` over the used slots
(few ops: what decode batches of many small segments need), ``segments`` loops over the segments
(when padding would waste more than it saves: a long prefill chunk beside short ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# the batched plan pads every segment to the longest; beyond this many padded rows per real row the
# segment loop is cheaper (its ops cost a few microseconds each, padded rows cost a full shrink)
MAX_PADDING = 2.0


@dataclass(slots=True)
class LoRAStepMapping:
    """Which tokens of the step run which slot, on the model's device (built once per step).

    The adapted rows are taken in slot order (``order``); the kernel's output rows follow the same
    order and are added back at ``order``.
    """

    num_slots: int
    # [N] rows of the flat batch in slot order (batched plan: padded to num_used x width, a pad
    # position repeats its segment's first row); None: rows 0..T-1 as they are
    order: torch.Tensor | None
    # batched plan: [num_used] the slots in use, ascending; None: all slots, each a segment
    slots: torch.Tensor | None
    # batched plan: [num_used, width, 1] True at padding (its shrink is zeroed); None: no padding
    pad: torch.Tensor | None
    # rows per segment in the batched plan
    width: int
    # segments plan: (slot, start, end) positions in ``order``; None: the batched plan
    segments: tuple[tuple[int, int, int], ...] | None


@runtime_checkable
class LoRAKernel(Protocol):
    """How one platform adds the slots' adapters to a linear layer's output."""

    name: str

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        mapping: LoRAStepMapping, slice_widths: tuple[int, ...] | None = None) -> torch.Tensor:
        """``y`` [T, out] plus each mapped row's ``(x · A[slot]ᵀ) · B[slot]``; returns the sum (may be ``y``).

        ``lora_a``: [max_loras * R, in] (slot s holds rows s*R .. s*R+R-1, zero past the adapter's rank);
        ``lora_b``: [max_loras * R, out] (B transposed, scaled). ``x`` [T, in] in the model dtype.
        ``slice_widths``: a packed layer's stacked projections, in column order (None: one over all
        ``out``); each owns ``R / len(slice_widths)`` consecutive rows of a slot and only its columns of B.
        """
        ...


class TorchLoRAKernel:
    """The grouped (SGMV-style) torch kernel (see the module docstring)."""

    name = "torch"

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        mapping: LoRAStepMapping, slice_widths: tuple[int, ...] | None = None) -> torch.Tensor:
        block = lora_a.shape[0] // mapping.num_slots
        widths = slice_widths or (lora_b.shape[1],)
        rank = block // len(widths)
        cols = _column_ranges(widths)
        xs = x if mapping.order is None else x.index_select(0, mapping.order)
        xs = xs.to(lora_a.dtype)
        if mapping.segments is None:
            delta = _batched(xs, lora_a, lora_b, mapping, block, rank, cols)
        else:
            delta = torch.cat([_segment(xs[start:end], lora_a, lora_b, slot * block, rank, cols)
                               for slot, start, end in mapping.segments])
        delta = delta.to(y.dtype)
        if mapping.order is None:
            return y + delta if y.requires_grad else y.add_(delta)
        return y.index_add(0, mapping.order, delta) if y.requires_grad else y.index_add_(0, mapping.order, delta)


def _column_ranges(widths: tuple[int, ...]) -> list[tuple[int, int]]:
    out, start = [], 0
    for w in widths:
        out.append((start, start + w))
        start += w
    return out


def _batched(xs: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAStepMapping, block: int,
             rank: int, cols: list[tuple[int, int]]) -> torch.Tensor:
    """Every used slot's segment padded to ``mapping.width``: one bmm per stage (and per stacked slice)."""
    a = lora_a.view(mapping.num_slots, block, -1)
    b = lora_b.view(mapping.num_slots, block, -1)
    if mapping.slots is not None:
        a = a.index_select(0, mapping.slots)
    shrunk = torch.bmm(xs.view(a.shape[0], mapping.width, -1), a.transpose(1, 2))  # [S, width, block]
    if mapping.pad is not None:
        shrunk.masked_fill_(mapping.pad, 0)  # a pad repeats its segment's first row: that row is added once
    parts = []
    for i, (lo, hi) in enumerate(cols):
        bi = b[:, i * rank:(i + 1) * rank, lo:hi]
        if mapping.slots is not None:
            bi = bi.index_select(0, mapping.slots)
        parts.append(torch.bmm(shrunk[:, :, i * rank:(i + 1) * rank], bi))
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return delta.view(-1, delta.shape[-1])


def _segment(xs: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, first: int, rank: int,
             cols: list[tuple[int, int]]) -> torch.Tensor:
    """One slot's contiguous rows: shrink with its A, expand each stacked slice with its own block of B."""
    shrunk = xs @ lora_a[first:first + rank * len(cols)].t()
    parts = [shrunk[:, i * rank:(i + 1) * rank] @ lora_b[first + i * rank:first + (i + 1) * rank, lo:hi]
             for i, (lo, hi) in enumerate(cols)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


TORCH_LORA_KERNEL = TorchLoRAKernel()


def build_step_mapping(token_slots: torch.Tensor, num_slots: int, device: torch.device) -> LoRAStepMapping | None:
    """The mapping for ``token_slots`` ([T] integers on the host, -1 = no adapter); None when no row has one."""
    token_slots = token_slots.to(torch.int64)
    rows = torch.nonzero(token_slots >= 0).squeeze(1)
    count = len(rows)
    if count == 0:
        return None
    slots_of_rows = token_slots[rows]
    perm = torch.argsort(slots_of_rows, stable=True)
    sorted_rows, sorted_slots = rows[perm], slots_of_rows[perm]
    used, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    width = int(counts.max())
    identity = count == len(token_slots) and bool((sorted_rows == torch.arange(count)).all())
    if len(used) * width <= MAX_PADDING * count:
        lane = torch.arange(width)
        valid = lane.unsqueeze(0) < counts.unsqueeze(1)  # [S, width]
        positions = torch.where(valid, starts.unsqueeze(1) + lane.unsqueeze(0), starts.unsqueeze(1))
        padded = not bool(valid.all())
        order = None if identity and not padded else sorted_rows[positions.reshape(-1)]
        all_slots = len(used) == num_slots  # unique and ascending, so exactly 0..num_slots-1
        return LoRAStepMapping(
            num_slots=num_slots, order=None if order is None else order.to(device, non_blocking=True),
            slots=None if all_slots else used.to(device, non_blocking=True),
            pad=(~valid).unsqueeze(-1).to(device, non_blocking=True) if padded else None,
            width=width, segments=None)
    segments = tuple((int(s), int(a), int(a + c)) for s, a, c in zip(used.tolist(), starts.tolist(), counts.tolist()))
    return LoRAStepMapping(num_slots=num_slots, order=None if identity else sorted_rows.to(device, non_blocking=True),
                           slots=None, pad=None, width=width, segments=segments)
