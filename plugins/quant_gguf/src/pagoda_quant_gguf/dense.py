"""The batched path of a GGUF layer kept in blocks: weight panels dequantized into a small buffer, then ``F.linear``.

The block kernels (``kernels``) quantize x to int8 and do integer dot products on the blocks: with a few
rows a step is a read of the weight, and the blocks (a quarter of bf16's bytes for Q4) win. With many
rows (prefill, a 64-row decode batch, the start-up's dummy step) the step is compute-bound, and there a
dense float matmul (oneDNN / MKL behind ``F.linear``) can be faster than the block kernel. So above a
row count, ``DensePath`` dequantizes the weight one panel at a time -- ``PANEL_BYTES`` of float32 rows,
which stays in the cache between its dequantization and its matmul -- and runs ``F.linear`` on each
panel into its columns of y. The memory stays the blocks' (a panel buffer per call, freed after it; no
dequantized copy of a weight is kept). The float32 matmul is the one every CPU has at full speed
(bfloat16 ``F.linear`` without AVX512_BF16 / AMX measured 5-10x slower than float32 on Zen 3);
bfloat16 / float16 activations are widened once a call and y rounded once, as the block kernel does.

Where the dense path starts is measured per CPU, per GGML type and activation dtype (``min_rows``):
both paths on one thread (thread CPU time, best of a few interleaved repetitions, as
``pagoda_platform_cpu.gemm_tuning`` does) at doubling row counts; the threshold is the first row count
where the dense path is faster by ``MARGIN`` there and at the next one (or at the largest, alone). Kept in the disk cache by CPU
model and flags, torch version and this plugin's kernel sources; measured at the first call that could
use it (the start-up's dummy step), ~0.1-0.5 s of CPU time once per machine. ``PAGODA_GGUF_DENSE_MIN_ROWS``
forces it (a row count, or ``off``: the block kernels at every row count).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from pagoda import envs
from pagoda_quant_gguf import kernels
from pagoda_quant_gguf.dequant import block_size, dequantize_blocks, type_name

logger = logging.getLogger(__name__)

PANEL_BYTES = 8 << 20  # float32 panel: L3-resident between its dequantization and its matmul (see the docs)
ROWS = (32, 64, 128, 256, 512, 1024)  # measured row counts, ascending
SHAPE = (1536, 512)  # out, in features: whole blocks of every type (K-quants: 256 values)
MARGIN = 1.05  # the dense path must be this much faster at two consecutive row counts
REPEATS = 3
TIME_LIMIT_S = 3.0  # of thread CPU time a measurement may take; past it: not trusted, not cached
FORMAT = 1  # bump when the measurement changes meaning


def panel_rows(cols: int) -> int:
    """Rows of a panel of ``cols`` float32 values: PANEL_BYTES' worth, a multiple of 4 (a repacked group)."""
    return max(4, PANEL_BYTES // (4 * cols) // 4 * 4)


class DensePath:
    """``x`` [M, cols] times one block matrix (uint8 [rows, bytes per row], repacked when ``packed``),
    transposed, panel by panel; y [M, rows] in ``out_dtype``."""

    __slots__ = ("blocks", "cols", "dequantize", "packed", "panel", "ptr", "qtype", "rows")

    def __init__(self, blocks: torch.Tensor, qtype: int, cols: int, packed: bool) -> None:
        lib = kernels.library()
        assert lib is not None
        self.blocks, self.qtype, self.cols, self.packed = blocks, qtype, cols, packed
        self.rows = int(blocks.shape[0])
        self.ptr = blocks.data_ptr()
        self.dequantize = lib.pagoda_gguf_dequantize
        self.panel = min(panel_rows(cols), self.rows)

    def _fill(self, buf: torch.Tensor, row0: int, count: int, threads: int) -> None:
        if not kernels.dequantizes_in_cpp(self.qtype):  # K-quants: torch's dequantizer, on the stored rows
            buf[:count].copy_(dequantize_blocks(self.blocks[row0:row0 + count], self.qtype, self.cols))
            return
        status = self.dequantize(self.qtype, int(self.packed), self.ptr, self.rows, self.cols, row0, count,
                                 buf.data_ptr(), threads)
        if status != 0:
            raise RuntimeError(f"gguf dequantizer refused type {type_name(self.qtype)} rows {row0}+{count}")

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        buf = torch.empty((self.panel, self.cols), dtype=torch.float32)
        threads = torch.get_num_threads()
        if self.panel == self.rows:  # one panel: the matmul's own output, no copy into y
            self._fill(buf, 0, self.rows, threads)
            return F.linear(xf, buf).to(out_dtype)
        y = torch.empty((x.shape[0], self.rows), dtype=out_dtype)
        for row0 in range(0, self.rows, self.panel):
            count = min(self.panel, self.rows - row0)
            self._fill(buf, row0, count, threads)
            y[:, row0:row0 + count] = F.linear(xf, buf[:count])  # (the copy rounds to out_dtype once)
        return y


def _best_seconds(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(REPEATS):
        for name, fn in fns.items():  # interleaved: a neighbour's turn hits both alike
            start = time.thread_time()
            fn()
            times[name].append(time.thread_time() - start)
    return {name: min(ts) for name, ts in times.items()}


class TooBusy(RuntimeError):
    """The measurement took too long to be trusted."""


def measure(qtype: int, dtype: torch.dtype) -> tuple[int, dict[int, float]]:
    """(threshold, or 0 where the block kernel wins at every row count measured; {rows: block time / dense time})."""
    started = time.thread_time()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, k = SHAPE
        values, nbytes = block_size(qtype)
        gen = torch.Generator().manual_seed(0)
        # random bytes are valid blocks once the f16 scales are small and finite: every byte of a block
        # is random, then its scale fields are overwritten (as the kernel tests build K-quant blocks)
        blocks = torch.randint(0, 256, (n, k // values * nbytes), dtype=torch.uint8, generator=gen)
        _set_small_scales(blocks, qtype, nbytes, gen)
        packed = kernels.repack(blocks, qtype, k)
        weight = packed if packed is not None else blocks
        dense = DensePath(weight, qtype, k, packed is not None)
        ratios: dict[int, float] = {}
        wins = 0
        for rows in ROWS:
            if time.thread_time() - started > TIME_LIMIT_S:
                raise TooBusy(f"the measurement took over {TIME_LIMIT_S:.1f} s of CPU time")
            x = torch.randn(rows, k, generator=gen).to(dtype)
            s = _best_seconds({
                "block": lambda x=x: kernels.matmul(x, weight, qtype, k, packed=packed is not None, out_dtype=dtype),
                "dense": lambda x=x: dense(x, dtype),
            })
            ratios[rows] = s["block"] / s["dense"]
            wins = wins + 1 if ratios[rows] >= MARGIN else 0
            if wins == 2:
                return ROWS[ROWS.index(rows) - 1], ratios
        # a win at the largest row count stands alone (larger steps are more compute-bound still)
        return (ROWS[-1] if wins else 0), ratios
    finally:
        torch.set_num_threads(before)


def _set_small_scales(blocks: torch.Tensor, qtype: int, nbytes: int, gen: torch.Generator) -> None:
    per_block = blocks.view(blocks.shape[0], -1, nbytes)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (torch.rand(per_block.shape[:2], generator=gen) * 0.015 + 0.005).to(torch.float16)
        per_block[..., offset:offset + 2] = scales.unsqueeze(-1).view(torch.uint8).reshape(*per_block.shape[:2], 2)


# where each type's blocks keep their f16 scale(s) (ggml-common.h)
SCALE_OFFSETS: dict[int, tuple[int, ...]] = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82),
                                             11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def _cache_path(qtype: int, dtype: torch.dtype) -> Path | None:
    from pagoda.disk_cache import cache_root

    root = cache_root()
    if root is None:
        return None
    from pagoda.cpp_extension.prebuilt import build_key

    # the kernel library's key (its sources, this CPU's model and flags) and what else the figures depend on
    sources = [resources.files("pagoda_quant_gguf").joinpath(f"csrc/{name}").read_text()
               for name in ("gguf_gemm.cpp", "gguf_kquants.cpp", "gguf_common.h")]
    key = build_key("gguf_dense", sources, [[type_name(qtype), str(dtype), torch.__version__, str(FORMAT),
                                             str(SHAPE), str(PANEL_BYTES)]])[:24]
    return root / "gguf_dense" / f"{key}.json"


@cache
def _measured_min_rows(qtype: int, dtype: torch.dtype) -> int:
    path = _cache_path(qtype, dtype)
    if path is not None and path.exists():
        try:
            return int(json.loads(path.read_text())["min_rows"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    name = f"{type_name(qtype)} {str(dtype).removeprefix('torch.')}"
    try:
        rows, ratios = measure(qtype, dtype)
    except TooBusy as exc:
        logger.warning("gguf %s: dense batched path off for this process: %s; not cached", name, exc)
        return 0
    curve = ", ".join(f"{r}: {v:.2f}" for r, v in ratios.items())
    logger.info("gguf %s: dense batched path %s (block kernel time / dense time by rows, one core: %s)", name,
                f"from {rows} rows" if rows else "off (the block kernel wins)", curve)
    if path is not None:
        from pagoda.disk_cache import atomic_write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"min_rows": rows, "ratios": ratios}))
    return rows


def min_rows(qtype: int, dtype: torch.dtype) -> int:
    """The row count from which a ``qtype`` layer with ``dtype`` activations takes the dense path; 0: never."""
    forced = envs.PAGODA_GGUF_DENSE_MIN_ROWS
    if forced is not None:
        return forced
    if dtype not in kernels.DTYPE_CODES or qtype not in SCALE_OFFSETS:
        return 0
    return _measured_min_rows(qtype, dtype)


def smallest_candidate() -> int:
    """Below this many rows no call asks ``min_rows`` (decode stays on a few attribute reads)."""
    forced = envs.PAGODA_GGUF_DENSE_MIN_ROWS
    return ROWS[0] if forced is None else (forced or 1 << 62)
