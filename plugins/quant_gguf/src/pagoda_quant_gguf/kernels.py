"""The CPU kernel on GGUF blocks, built once per machine through ``pagoda.cpp_extension``: ``csrc/gguf_gemm.cpp``
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and ``csrc/gguf_kquants.cpp`` (Q2_K .. Q6_K), one library, one entry point.

``matmul`` serves decode and prefill; ``supports`` says whether a call can take it (a CPU tensor,
a block type the kernel handles, the library built). Set ``PAGODA_GGUF_KERNEL=0`` to force the
plain-torch reference path (dequantize per call) for A/B measurements.
"""

from __future__ import annotations

from types import ModuleType

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from pagoda import envs
from pagoda.cpp_extension import CppExtension, ExtensionBuildError

EXTENSION = CppExtension("pagoda_gguf_gemm", "pagoda_quant_gguf", ["csrc/gguf_gemm.cpp", "csrc/gguf_kquants.cpp"])
KERNEL_TYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))
KERNEL_ENV = "PAGODA_GGUF_KERNEL"

_library: ModuleType | None = None


def library() -> ModuleType | None:
    """The compiled library, or None when it cannot be built here (the reason: ``EXTENSION.build_failure()``)."""
    global _library
    if _library is None and envs.PAGODA_GGUF_KERNEL:
        try:
            _library = EXTENSION.library()
        except ExtensionBuildError:
            return None
    return _library


def supports(qtype: int, x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and qtype in KERNEL_TYPES and x.shape[-1] % GGML_QUANT_SIZES[Q(qtype)][0] == 0
            and library() is not None)


def describe() -> str:
    lib = library()
    if lib is None:
        return f"none ({EXTENSION.build_failure() or KERNEL_ENV + '=0'}): torch reference"
    repacked = [Q(t).name for t in sorted(KERNEL_TYPES) if lib.pagoda_gguf_repacks(t)]
    return (f"{lib.pagoda_gguf_isa().decode()} for {', '.join(Q(t).name for t in sorted(KERNEL_TYPES))}"
            + (f"; {', '.join(repacked)} repacked at load" if repacked else ""))


def repack(blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor | None:
    """The matrix rewritten into the kernel's repacked layout (as many bytes: groups of 4 rows with their
    blocks' scales apart from their quants, see ``csrc/gguf_gemm.cpp``), or None where this build has no
    repacked kernel for the type (the stored layout stays)."""
    lib = library()
    if lib is None or blocks.device.type != "cpu" or blocks.dim() != 2:
        return None
    blocks = blocks.contiguous()
    packed = torch.empty_like(blocks)
    if lib.pagoda_gguf_repack(qtype, blocks.data_ptr(), blocks.shape[0], cols, packed.data_ptr()) != 0:
        return None
    return packed


def unpack_rows(packed: torch.Tensor, qtype: int, cols: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ids) of a repacked matrix, in the stored layout: uint8 [len(rows), bytes per row]."""
    lib = library()
    assert lib is not None
    rows = rows.to(torch.int64).contiguous()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= packed.shape[0]):
        raise IndexError(f"row ids out of range for a matrix of {packed.shape[0]} rows")
    out = torch.empty((rows.numel(), packed.shape[1]), dtype=torch.uint8)
    status = lib.pagoda_gguf_unpack_rows(qtype, packed.data_ptr(), packed.shape[0], cols, rows.data_ptr(), rows.numel(),
                                         out.data_ptr())
    if status != 0:
        raise RuntimeError(f"gguf kernel cannot read rows of a repacked {Q(qtype).name} matrix")
    return out


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int, packed: bool = False) -> torch.Tensor:
    """``x`` [M, cols] times the block matrix (uint8 [N, bytes per row], repacked by ``repack`` when
    ``packed``), transposed: float32 [M, N]."""
    lib = library()
    assert lib is not None
    x = x.to(torch.float32).contiguous()
    n = blocks.shape[0]
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    fn = lib.pagoda_gguf_matmul_packed if packed else lib.pagoda_gguf_matmul
    status = fn(qtype, blocks.data_ptr(), n, cols, x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"gguf kernel refused type {Q(qtype).name} with {cols} columns{' (repacked)' if packed else ''}")
    return y
