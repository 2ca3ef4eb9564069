"""The GPTQ and AWQ checkpoint layouts of a quantized linear layer, and the plain-torch reference.

Both store ``w[k, n] = scales[g, n] * (q[k, n] - zero[g, n])`` for input channel ``k``, output
channel ``n`` and group ``g`` of ``k``, with ``q`` and ``zero`` packed 32 / bits to an int32 (the
lowest bits first; 4-bit: eight nibbles; GPTQ also 8-bit: four bytes):

* GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` ``gptq``): ``qweight`` int32 [K / 8, N] packed
  along K (nibble j of row i is input channel 8 i + j; 8-bit: [K / 4, N]); ``qzeros`` int32 [G, N / 8] packed along N
  and stored as zero - 1 (AutoGPTQ's v1 convention; ``gptq_v2`` stores the zero itself);
  ``scales`` [G, N]; ``g_idx`` int32 [K], the group of each input channel (i // group_size, or a
  permutation of that for act-order, ``desc_act``, checkpoints).
* AWQ (AutoAWQ's GEMM version): ``qweight`` int32 [K, N / 8] packed along N in AWQ's interleaved
  order (nibble j holds column ``AWQ_PACK_ORDER[j]`` of its eight); ``qzeros`` int32 [G, N / 8] in
  the same order, zeros stored as they are; ``scales`` [G, N]; group of k = k // group_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

PACK_FACTOR = 8  # 4-bit values per int32 (the two formats' common case)
# AWQ's GEMM packing: nibble j of an int32 holds column AWQ_PACK_ORDER[j] of its eight columns ...
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column c sits at nibble AWQ_NIBBLE_OF_COLUMN[c]
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(c) for c in range(PACK_FACTOR))

Format = Literal["gptq", "awq"]


@dataclass
class PackedCheckpoint:
    """One linear layer's 4-bit tensors as the checkpoint stores them (fused layers: along N, concatenated)."""

    format: Format
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None  # GPTQ only
    group_size: int  # resolved: in_features when the checkpoint says -1
    zero_offset: int  # added to the stored zeros: 1 for GPTQ v1 ("zeros minus one"), else 0
    in_features: int
    out_features: int
    bits: int = 4  # GPTQ: 4 or 8; AWQ: 4
    # rows of scales / qzeros when they are not ceil(in_features / group_size): an act-order layer split
    # over its input features keeps every group (its g_idx names them), each rank its slice of g_idx
    groups: int | None = None

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[0])

    def validate(self, name: str) -> None:
        """ValueError naming the tensor whose shape or dtype does not fit a layer of in_features x out_features."""
        k, n, pf = self.in_features, self.out_features, self.pack_factor
        if k % pf or n % pf:
            raise ValueError(f"{name}: a {self.bits}-bit {self.format} layer needs in and out features that are "
                             f"multiples of {pf} (it has {k} x {n})")
        groups = self.groups if self.groups is not None else -(-k // self.group_size)
        qweight_shape = (k // pf, n) if self.format == "gptq" else (k, n // pf)
        expected: dict[str, tuple[int, ...]] = {"qweight": qweight_shape, "qzeros": (groups, n // pf),
                                                "scales": (groups, n)}
        if self.format == "gptq":
            expected["g_idx"] = (k,)
        for tensor_name, shape in expected.items():
            tensor = getattr(self, tensor_name)
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"{name}.{tensor_name}: shape {got}, a {self.format} layer of {k} inputs x {n} "
                                 f"outputs in groups of {self.group_size} stores {shape}")
        for tensor_name in ("qweight", "qzeros"):
            if getattr(self, tensor_name).dtype != torch.int32:
                raise ValueError(f"{name}.{tensor_name} is {getattr(self, tensor_name).dtype}, {self.format} packs int32")
        if not self.scales.is_floating_point():
            raise ValueError(f"{name}.scales is {self.scales.dtype}, not a float type")
        if self.g_idx is not None:
            if self.g_idx.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}.g_idx is {self.g_idx.dtype}, not int32")
            if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= groups):
                raise ValueError(f"{name}.g_idx holds groups outside 0 .. {groups - 1}")


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [...] -> [..., 32 / bits] of its bit fields, the lowest first (a negative int32 is just its bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def unpack_columns(packed: torch.Tensor, fmt: Format, bits: int = 4) -> torch.Tensor:
    """[R, N * bits / 32] int32 packed along N (qzeros; AWQ's qweight) -> [R, N] int values in column order."""
    values = _fields(packed, bits)
    if fmt == "awq":
        values = values[..., list(AWQ_NIBBLE_OF_COLUMN)]
    return values.reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """GPTQ's qweight [K * bits / 32, N] packed along K -> [K, N] int values."""
    return _fields(packed, bits).permute(0, 2, 1).reshape(-1, packed.shape[1])


def group_index(ckpt: PackedCheckpoint) -> torch.Tensor:
    """int64 [K]: the group of each input channel."""
    if ckpt.g_idx is not None:
        return ckpt.g_idx.long()
    return torch.arange(ckpt.in_features, device=ckpt.qweight.device) // ckpt.group_size


def unpack(ckpt: PackedCheckpoint) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [K, N] uint8, zeros [G, N] float32 with the format's offset applied, scales [G, N] float32)."""
    q = unpack_rows(ckpt.qweight, ckpt.bits) if ckpt.format == "gptq" else unpack_columns(ckpt.qweight, "awq")
    zeros = unpack_columns(ckpt.qzeros, ckpt.format, ckpt.bits).float() + ckpt.zero_offset
    return q.to(torch.uint8), zeros, ckpt.scales.float()


def dequantize(ckpt: PackedCheckpoint) -> torch.Tensor:
    """The float32 weight [N, K] (``nn.Linear``'s layout): the reference every kernel is checked against."""
    q, zeros, scales = unpack(ckpt)
    g = group_index(ckpt)
    return ((q.float() - zeros[g]) * scales[g]).t().contiguous()
