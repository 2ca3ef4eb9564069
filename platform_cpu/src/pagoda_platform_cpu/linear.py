"""CPU linear layers: a streaming GEMV for decode-sized inputs, oneDNN's packed matmul above.

This module serves CPUs without AVX-512 (and bf16 without AVX512_BF16). Where the CPU has
them, linears run on ``pagoda_platform_cpu.gemm`` instead (one packed copy, faster than
both paths below at every row count measured).

``F.linear`` hands MKL/oneDNN a plain [out, in] weight, which is re-blocked on
every call; at decode batch sizes that dominates. Packing once after loading
measured, on the 2-core AVX512 reference VM (GFLOP/s, F.linear -> packed):
fp32 M=64 122-165 -> 161-212, LM head (49152 x 576) 81 -> 190; bf16 M=1 12-21 -> 23-57,
M=64 161-273 -> 296-355. Numerics are oneDNN's (fp32 accumulation), as for F.linear.

With a few rows a linear layer is a read of its weight, and oneDNN's packed matmul
reads it at 60-80% of the memory's speed. ``GemvLinearKernel`` answers inputs of up
to ``max_rows`` rows with the C++ GEMV of ``pagoda_platform_cpu.gemv``, which reads
the plain row-major weight at the speed of a bare read loop; larger inputs go to the
packed copy. Decode of SmolLM2-135M, B concurrent greedy streams (so B rows per linear),
one engine alternating the two paths (ms a step, lower quartile):

    B             1     2     3     4     6     8
    bf16 GEMV   13.8  14.2  14.5  17.0  19.2  21.7
    bf16 packed 19.0  20.6  18.2  18.5  18.4  21.5
    fp32 GEMV   19.1  19.5  21.0  24.4  30.7
    fp32 packed 28.7  31.5  24.8  24.4  24.6

hence ``GEMV_MAX_ROWS``: each extra row costs the GEMV one more multiply per weight
element, while the packed matmul's cost stays near its read time up to ~8 rows.

Memory policy: the GEMV needs the plain weight and the packed path its own copy, so
keeping both doubles a layer's memory. Packed copies are kept while their total stays
within ``packed_budget_bytes`` (by default an eighth of the host's RAM: every layer of
a model up to ~1B parameters in bf16 on a 16 GiB host); layers past the budget keep
only the plain weight, take the GEMV up to ``GEMV_MAX_ROWS_UNPACKED`` rows and
``F.linear`` above. For big models the plain weight is the one to keep: decode,
memory-bound, is where CPU serving spends its time and the GEMV is the fastest reader
there, while ``F.linear``'s per-call re-blocking costs less as rows grow (one decoder
layer's matrices, hot, F.linear vs packed: bf16 -25% at 16 rows, -18% at 64, -4% at 512;
fp32 -45%, -32%, -17%). The GEMV beats F.linear on plain weights up to ~16 rows in fp32
and ~24 in bf16 (all 120 matrices, ms, GEMV vs F.linear: bf16 8 rows 11.7 / 20.3,
16 rows 21.0 / 24.1, 32 rows 42.8 / 31.9; fp32 8 rows 25.2 / 43.3, 16 rows 50.6 / 52.2).
A weight shared with another module (the tied LM head's embedding) is read in place:
the GEMV takes the model's own tensor, no copy.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.layers.linear import LinearKernel

logger = logging.getLogger(__name__)

# Batch-size hint for the packed layout: decode batches are tens of rows, and the
# layout chosen for 64 measured as fast at 1 and 512 rows as each size's own.
PACK_BATCH_HINT = 64

# Inputs of at most this many rows take the GEMV (the crossover measured above).
GEMV_MAX_ROWS = {torch.float32: 3, torch.bfloat16: 4}
# ... and for a layer that kept no packed copy, where the alternative is F.linear.
GEMV_MAX_ROWS_UNPACKED = 16
PACKED_BUDGET_FRACTION = 1 / 8


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _reorder(weight: torch.Tensor) -> Any:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: its bf16 packing needs AVX512BW/VL/DQ or
    AVX-NE-CONVERT and raises on a plain AVX2 CPU (or under ``ONEDNN_MAX_CPU_ISA=AVX2``)."""
    try:
        _reorder(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as exc:
        logger.info("oneDNN does not pack %s weights on this CPU (%s): they are packed as float32", dtype, exc)
        return False
    return True


@dataclass
class WidenedWeight:
    """A weight oneDNN cannot pack in its own dtype, packed as float32."""

    packed: Any
    dtype: torch.dtype


class OneDNNLinearKernel:
    """oneDNN's matmul on a weight packed once. A bf16 weight on a CPU where oneDNN cannot pack bf16
    (a plain AVX2 CPU) is packed as float32 instead: bf16 values are exact in float32 and oneDNN's bf16
    matmul accumulates in float32 too, so the input is widened and the result rounded once, as that
    matmul would round it. It costs twice the weight's memory and, on such a CPU, runs ~3.6x faster
    than F.linear in bf16 (served W3 68 tok/s through F.linear against 248 for float32 weights)."""

    name = "onednn_packed"

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> None:
        self.dtypes = dtypes
        # probed once per kernel
        self.widened = tuple(d for d in dtypes if d != torch.float32 and not _packs(d))

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes and weight.numel() > 0

    def packed_nbytes(self, weight: torch.Tensor) -> int:
        """Bytes the packed copy of ``weight`` takes (twice a bf16 weight's own where it is widened)."""
        return weight.numel() * (4 if weight.dtype in self.widened else weight.element_size())

    def prepare(self, weight: torch.Tensor) -> Any:
        if weight.dtype in self.widened:
            return WidenedWeight(_reorder(weight.float().contiguous()), weight.dtype)
        return _reorder(weight.contiguous())

    def apply(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(prepared, WidenedWeight):
            wide_bias = None if bias is None else bias.float()
            out = torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), prepared.packed, wide_bias, "none", [], "")
            return out.to(prepared.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), prepared, bias, "none", [], "")


@dataclass
class GemvPrepared:
    weight: torch.Tensor  # plain, contiguous [out, in]: the model's own tensor when it already was
    packed: Any | None  # the packer's copy; None past the memory budget or without a packer


class GemvLinearKernel:
    """The GEMV up to ``max_rows`` input rows, ``packer`` above; F.linear above ``max_rows_unpacked`` for layers without a packed copy.

    The GEMV extension must be built before this kernel is used (the platform checks).
    """

    def __init__(
        self,
        packer: LinearKernel | None,
        max_rows: int = 3,
        max_rows_unpacked: int = GEMV_MAX_ROWS_UNPACKED,
        packed_budget_bytes: int | None = None,
        dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    ) -> None:
        from pagoda_platform_cpu.gemv import kernel

        self._gemv = kernel().gemv
        self.packer = packer
        self.max_rows = max_rows
        self.max_rows_unpacked = max(max_rows, max_rows_unpacked)
        self.dtypes = dtypes
        if packed_budget_bytes is None:
            packed_budget_bytes = int(host_memory_bytes() * PACKED_BUDGET_FRACTION)
        self.packed_budget_bytes = packed_budget_bytes
        self.packed_bytes = 0
        self.unpacked_layers = 0
        self.name = "gemv+" + (packer.name if packer is not None else "f_linear")

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes and weight.numel() > 0

    def prepare(self, weight: torch.Tensor) -> GemvPrepared:
        plain = weight.contiguous()
        packed = None
        if self.packer is not None and self.packer.supports(plain):
            nbytes = getattr(self.packer, "packed_nbytes", None)
            size = nbytes(plain) if nbytes is not None else plain.numel() * plain.element_size()
            if self.packed_bytes + size <= self.packed_budget_bytes:
                packed = self.packer.prepare(plain)
                self.packed_bytes += size
            else:
                if self.unpacked_layers == 0:
                    logger.info(
                        "packed linear copies reached their budget (%.2f GiB): further layers keep only the "
                        "plain weight and use F.linear above %d rows",
                        self.packed_budget_bytes / (1 << 30), self.max_rows_unpacked,
                    )
                self.unpacked_layers += 1
        return GemvPrepared(plain, packed)

    def apply(self, x: torch.Tensor, prepared: GemvPrepared, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // max(1, x.shape[-1])
        packed = prepared.packed is not None and self.packer is not None
        if rows <= (self.max_rows if packed else self.max_rows_unpacked):
            if x.dim() == 2:
                return self._gemv(x, prepared.weight, bias)
            return self._gemv(x.reshape(-1, x.shape[-1]), prepared.weight, bias).reshape(*x.shape[:-1], -1)
        if packed and self.packer is not None:  # (packed implies a packer; spelled out for the type checker)
            return self.packer.apply(x, prepared.packed, bias)
        return F.linear(x, prepared.weight, bias)
