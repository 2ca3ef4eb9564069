"""The CPU kernel on GGUF blocks, built once per machine through ``pagoda.cpp_extension``: ``csrc/gguf_gemm.cpp``
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and ``csrc/gguf_kquants.cpp`` (Q2_K .. Q6_K), one library, one entry point.

``matmul`` serves decode and prefill (the layers bind ``pagoda_gguf_linear`` once at load instead, see
``config``); ``supports`` says whether a call can take it (a CPU tensor, a block type the kernel
handles, the library built). Set ``PAGODA_GGUF_KERNEL=0`` to force the
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
# the types pagoda_gguf_dequantize handles (the K-quants' panels are dequantized in torch)
CPP_DEQUANT_TYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))
KERNEL_ENV = "PAGODA_GGUF_KERNEL"
# pagoda_gguf_linear's codes for x's and y's dtype
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

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


def start_build() -> None:
    """Begin compiling the library in the background where an engine on the CPU will ask for it.

    Called when a GGUF checkpoint's method is resolved (in ``pagoda serve``'s API process, seconds
    before its engine core loads the weights): the compile (3.6 s on a fresh 2-vCPU machine) then
    runs beside the engine core's start, which waits for it on the build lock instead of compiling.
    """
    from pagoda.platforms import current_platform

    if envs.PAGODA_GGUF_KERNEL and current_platform().device_type == "cpu":
        EXTENSION.start()


def supports(qtype: int, x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and qtype in KERNEL_TYPES and x.shape[-1] % GGML_QUANT_SIZES[Q(qtype)][0] == 0
            and library() is not None)


def dequantizes_in_cpp(qtype: int) -> bool:
    return qtype in CPP_DEQUANT_TYPES


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
    """Rows ``rows`` (int64 ids) of a repacked matrix, in the stored layout: uint8 [len(rows), bytes per row].
    The kernel checks the ids' range (an id outside raises IndexError): no id is read on the host."""
    lib = library()
    assert lib is not None
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        rows = rows.to(torch.int64).contiguous()
    out = torch.empty((rows.numel(), packed.shape[1]), dtype=torch.uint8)
    status = lib.pagoda_gguf_unpack_rows(qtype, packed.data_ptr(), packed.shape[0], cols, rows.data_ptr(), rows.numel(),
                                         out.data_ptr())
    if status == -2:
        raise IndexError(f"row ids out of range for a matrix of {packed.shape[0]} rows")
    if status != 0:
        raise RuntimeError(f"gguf kernel cannot read rows of a repacked {Q(qtype).name} matrix")
    return out


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int, packed: bool = False,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` [M, cols] (float32, bfloat16 or float16) times the block matrix (uint8 [N, bytes per row],
    repacked by ``repack`` when ``packed``), transposed: [M, N] in ``out_dtype``."""
    lib = library()
    assert lib is not None
    if x.dtype not in DTYPE_CODES:
        x = x.to(torch.float32)
    x = x.contiguous()
    n = blocks.shape[0]
    y = torch.empty((x.shape[0], n), dtype=out_dtype)
    status = lib.pagoda_gguf_linear(qtype, int(packed), blocks.data_ptr(), n, cols, x.data_ptr(), DTYPE_CODES[x.dtype],
                                    x.shape[0], y.data_ptr(), DTYPE_CODES[out_dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"gguf kernel refused type {Q(qtype).name} with {cols} columns{' (repacked)' if packed else ''}")
    return y
