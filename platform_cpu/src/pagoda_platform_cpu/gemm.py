"""pagoda's CPU matmul: ``x @ W^T (+ b)`` from a weight packed once into 32-column panels (AVX-512).

A C++ kernel (``csrc/gemm.cpp``) built once per machine through ``pagoda.cpp_extension``:
float32 on AVX-512F, bfloat16 on AVX512_BF16 (``vdpbf16ps``). It beats both the GEMV and
oneDNN's packed matmul at every row count measured (figures in the source), so where the CPU
has it, it serves every linear layer of its dtypes alone, from one packed copy of each weight;
see ``pagoda_platform_cpu.platform`` for the choice and ``pagoda_platform_cpu.linear`` for the
paths other CPUs take. The register-tile height, any row counts handed to ``F.linear`` (where a
CPU measures oneDNN faster) and the engine's default step budget come from one start-up
measurement per CPU (``pagoda_platform_cpu.gemm_tuning``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pagoda.cpp_extension import CppExtension
from pagoda_platform_cpu.huge_pages import HugePageArena

EXTENSION_NAME = "pagoda_cpu_gemm"
SOURCE = "csrc/gemm.cpp"
# -ffp-contract=off: the SiLU-and-mul epilogue rounds as the layer ops do (built the same way); the
# matmul's multiply-adds are explicit instructions, which the flag does not touch.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
EXTENSION = CppExtension(EXTENSION_NAME, "pagoda_platform_cpu", [SOURCE], cflags=_CFLAGS)
PANEL = 32  # output columns per packed panel (kPanel in the source)
ROW_TILES = (8, 12, 14)  # register-tile heights the source has; 8 unless tuned (gemm_tuning)
DEFAULT_ROW_TILE = 8
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_STEP = {torch.float32: 1, torch.bfloat16: 2}  # k values per packed element group
_num_threads = torch.get_num_threads
_empty = torch.empty
_NO_FOLLOWER = (None, 0, 0)
_NEEDS = {torch.float32: "AVX-512F", torch.bfloat16: "AVX512_BF16 (with AVX512BW and AVX512VL)"}



class GemmLibrary:
    """The library's entry points by dtype."""

    def __init__(self, library: ModuleType) -> None:
        self.supports = library.pagoda_gemm_supports
        self.peak = library.pagoda_gemm_peak
        self.pack = {torch.float32: library.pagoda_gemm_pack_f32, torch.bfloat16: library.pagoda_gemm_pack_bf16}
        self.gemm = {torch.float32: library.pagoda_gemm_f32, torch.bfloat16: library.pagoda_gemm_bf16}


_library: GemmLibrary | None = None


def kernel() -> GemmLibrary:
    """The compiled library; builds it (or waits for its build) on first use. Raises ExtensionBuildError when it cannot be built."""
    global _library
    if _library is None:
        _library = GemmLibrary(EXTENSION.library())
    return _library


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run ``dtype`` here (no build, no such instructions), or None."""
    if dtype not in _DTYPE_CODES:
        return f"{dtype} is not covered (float32 and bfloat16 are)"
    failure = EXTENSION.build_failure()
    if failure is not None:
        return failure
    if not kernel().supports(_DTYPE_CODES[dtype]):
        return f"this CPU has no {_NEEDS[dtype]}"
    return None


def measure_peak_gflops(dtype: torch.dtype, threads: int | None = None, iterations: int = 2_000_000) -> float:
    """GFLOP/s of the kernel's multiply-add (fp32 FMA, bf16 ``vdpbf16ps``) on registers alone: the CPU's peak.

    ~2 ms a call on a 3 GHz core; the best of a few calls is the figure (the machine may be shared).
    """
    if unavailable_reason(dtype) is not None:
        raise RuntimeError(f"no packed-matmul kernel for {dtype} here: {unavailable_reason(dtype)}")
    return float(kernel().peak(_DTYPE_CODES[dtype], iterations // 16, threads or torch.get_num_threads()))


def measure_peak_gflops_thread_time(dtype: torch.dtype, iterations: int = 2_000_000) -> float:
    """The same loop on the calling thread alone, its FLOPs over that thread's CPU time (``time.thread_time``).

    On a shared core the wall-time figure counts the neighbours' turns; CPU time does not, so this is
    the figure to set beside matmuls timed in CPU time (``gemm_tuning``, ``benchmarks.matmul_table --cpu-time``).
    """
    if unavailable_reason(dtype) is not None:
        raise RuntimeError(f"no packed-matmul kernel for {dtype} here: {unavailable_reason(dtype)}")
    rounds = iterations // 16
    start = time.thread_time()
    kernel().peak(_DTYPE_CODES[dtype], rounds, 1)  # one OpenMP thread: the region runs on this thread
    seconds = time.thread_time() - start
    flops = rounds * 16 * (64.0 if dtype == torch.bfloat16 else 32.0)  # kChains chains; 2 FLOP a lane, pairs for bf16
    return flops / max(seconds, 1e-9) / 1e9


@dataclass(frozen=True)
class PackedWeight:
    packed: torch.Tensor  # [ceil(N/32), k-steps, 32, elements per k-step]
    out_features: int
    in_features: int
    # Read on every call: kept here rather than asked of the tensor each time.
    dtype: torch.dtype
    panels: int
    data_ptr: int
    kernel: Callable[..., int]  # the library's entry point for this dtype
    plain: torch.Tensor | None = None  # kept only where F.linear serves some row counts (gemm_tuning)
    # Packed for SiLU-and-mul (prepare_silu_and_mul): each panel 16 gate columns then the same 16 of up;
    # out_features is then the output's width, half the projection's.
    silu_and_mul: bool = False


def _interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[2 I, ...] (gate rows, then up rows) -> [ceil(I / 16) * 32, ...]: 16 gate rows, the same 16 up rows,
    and so on, zero-padded: the row order of a weight packed for the SiLU-and-mul epilogue."""
    half = t.shape[0] // 2
    groups = -(-half // (PANEL // 2))
    out = t.new_zeros((2, groups * (PANEL // 2), *t.shape[1:]))
    out[0, :half] = t[:half]
    out[1, :half] = t[half:]
    return out.reshape(2, groups, PANEL // 2, *t.shape[1:]).transpose(0, 1).reshape(groups * PANEL, *t.shape[1:])


class PackedGemmKernel:
    """A ``LinearKernel``: ``prepare`` packs the weight, ``apply`` multiplies; float32 and bfloat16."""

    name = "cpu_packed_gemm"

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
                 row_tile: int = DEFAULT_ROW_TILE, onednn_rows: tuple[tuple[int, int], ...] = (),
                 arena: HugePageArena | None = None) -> None:
        """``row_tile``: rows per register tile; ``onednn_rows``: [lo, hi) row ranges (hi 0: unbounded) that
        ``F.linear`` serves instead, where this CPU measured oneDNN faster (``gemm_tuning``); ``arena``: the
        huge-page memory packed weights are cut from (the platform's; a kernel made without one gets its own)."""
        if row_tile not in ROW_TILES:
            raise ValueError(f"row_tile must be one of {ROW_TILES}, got {row_tile}")
        for lo, hi in onednn_rows:
            if lo < 1 or (hi != 0 and hi <= lo):
                raise ValueError(f"onednn_rows: [lo, hi) ranges with 1 <= lo < hi (or hi = 0) expected, got {onednn_rows}")
        self._lib = kernel()
        self.dtypes = dtypes
        self.row_tile = row_tile
        self.onednn_rows = tuple(onednn_rows)
        self.arena = arena if arena is not None else HugePageArena()
        # The order the layers ran in, as a hint to the kernel: the weight each one's call was last followed
        # by (keyed by packed address), so a call prefetches the next one's first panels (csrc/gemm.cpp,
        # Follower). A wrong guess only costs the lines read.
        self._followers: dict[int, PackedWeight] = {}
        self._previous = 0

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes and weight.numel() > 0

    def prepare(self, weight: torch.Tensor) -> PackedWeight:
        """[N, K] -> [ceil(N/32), k-steps, 32, step] (step = 2 for bf16, 1 for fp32), zero-padded."""
        dtype = weight.dtype
        if weight.dim() != 2 or not weight.is_cpu or dtype not in _DTYPE_CODES or not self._lib.supports(_DTYPE_CODES[dtype]):
            raise RuntimeError(f"gemm_pack: a CPU weight [N, K] of a dtype this build supports expected, got {dtype}")
        weight = weight.contiguous()
        n, k = weight.shape
        step = _STEP[dtype]
        # In huge pages: at few rows the weight streams from memory every step (huge_pages).
        packed = self.arena.zeros((-(-n // PANEL), -(-k // step), PANEL, step), dtype)
        self._lib.pack[dtype](weight.data_ptr(), packed.data_ptr(), n, k, torch.get_num_threads())
        plain = weight if self.onednn_rows else None
        return PackedWeight(packed, n, k, dtype, packed.shape[0], packed.data_ptr(), self._lib.gemm[dtype], plain)

    def supports_silu_and_mul(self, weight: torch.Tensor) -> bool:
        """A [gate; up] projection (an even number of rows) this kernel can take."""
        return self.supports(weight) and weight.shape[0] % 2 == 0

    def prepare_silu_and_mul(self, weight: torch.Tensor) -> PackedWeight:
        """[2 I, K] (gate rows, then up rows) packed so each panel holds 16 gate columns and the same 16 of up;
        ``apply_silu_and_mul`` then writes silu(gate) * up, [T, I], from the matmul's registers."""
        if not self.supports_silu_and_mul(weight):
            raise RuntimeError(f"gemm: a [gate; up] weight of an even number of rows expected, got {tuple(weight.shape)}")
        packed = self.prepare(_interleave_gate_up(weight.contiguous()))
        return dataclasses.replace(packed, out_features=weight.shape[0] // 2, plain=None, silu_and_mul=True)

    def apply_silu_and_mul(self, x: torch.Tensor, prepared: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) * up of ``x @ [gate; up]^T + bias``, rounded as the separate projection and
        ``silu_and_mul`` round: bit for bit their result."""
        if not prepared.silu_and_mul:
            raise RuntimeError("gemm: apply_silu_and_mul needs a weight from prepare_silu_and_mul")
        return self.apply(x, prepared, bias)

    def apply(self, x: torch.Tensor, prepared: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        # Called for every linear layer of every step: the 2-D case reads each attribute once, inline.
        shape = x.shape
        if len(shape) != 2:
            return self.apply(x.reshape(-1, shape[-1]), prepared, bias).reshape(*shape[:-1], -1)
        dtype = x.dtype
        if dtype is not prepared.dtype or not x.is_cpu:
            raise RuntimeError(
                f"gemm: CPU x in the packed weight's dtype expected (x's dtype is {dtype}, the weight's {prepared.dtype})"
            )
        m, k = shape
        if self.onednn_rows and prepared.plain is not None and self._onednn_takes(m):
            return F.linear(x, prepared.plain, bias)
        n = prepared.out_features
        if k != prepared.in_features:
            raise RuntimeError(f"gemm: x has {k} columns and N is {n}, the packed weight does not fit them")
        row_stride, column_stride = x.stride()
        if column_stride != 1 and k > 1:
            x = x.contiguous()
            row_stride = k
        gated = prepared.silu_and_mul
        bias_ptr = None
        if bias is not None:
            width = 2 * n if gated else n
            if bias.numel() != width:
                raise RuntimeError(f"gemm: bias of [{width}] expected")
            # float32, padded to whole panels, so the last panel's bias load stays in bounds.
            if gated:
                padded = _interleave_gate_up(bias.reshape(width).float())
            else:
                padded = torch.zeros(prepared.panels * PANEL, dtype=torch.float32)
                padded[:n] = bias.reshape(n)
            bias = padded
            bias_ptr = padded.data_ptr()
        y = _empty(m, n, dtype=dtype)
        address = prepared.data_ptr
        if self._previous and self._previous != address:
            self._followers[self._previous] = prepared
        self._previous = address
        follower = self._followers.get(address)
        if m and prepared.kernel(
            x.data_ptr(), row_stride, m, k, address, prepared.panels, bias_ptr, y.data_ptr(), n, _num_threads(),
            self.row_tile, *((follower.data_ptr, follower.panels, follower.in_features) if follower is not None
                             and follower.dtype is dtype else _NO_FOLLOWER), 1 if gated else 0,
        ):
            raise RuntimeError(f"gemm: this build has no {dtype} kernel")
        return y

    def _onednn_takes(self, rows: int) -> bool:
        return any(lo <= rows and (hi == 0 or rows < hi) for lo, hi in self.onednn_rows)
