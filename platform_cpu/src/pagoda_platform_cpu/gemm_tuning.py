"""Per-CPU choices for the packed matmul, from a short measurement: tile height, F.linear rows, step budget.

CPUs differ where it matters to a matmul: Zen 4 and most client cores split a 512-bit
multiply-add over two 256-bit halves, Zen 5 and Xeon servers issue two full ones a cycle, and
the same kernel sits at a different point of its curve on each (on the 2-vCPU Zen 4 VM pagoda's
bf16 matmul is near its peak from 64 rows; on a full-512-bit Zen 5 it was reported at 692
GFLOP/s at 512 rows against oneDNN's 936, and ahead again at 2,048). So instead of constants,
one measurement on the machine itself, once per CPU model, dtype, torch and kernel source
(kept in the on-disk cache; ~0.3 s bf16, ~0.6 s fp32 on a quiet core the first time):

1. the register-tile height (``gemm.ROW_TILES``) at 512 rows; a taller tile must win by 3%;
2. pagoda against ``F.linear`` (oneDNN) at 64 to 2,048 rows: where oneDNN is faster by 10%
   or more, the linear layers hand those row counts to ``F.linear`` (keeping the plain weight
   beside the packed one, only then);
3. the step's token budget: the smallest of 512, 1,024 and 2,048 rows where the better of the
   two reaches 90% of its best rate over those three -- a bigger step only pays while the
   matmul is still speeding up, and every token of it delays the running decodes.

It runs on one thread (the per-core efficiency decides all three; on a shared machine a
multi-threaded region waits for its slowest thread, which made a 2-thread measurement swing
10x) and times everything -- the peak loop, pagoda, ``F.linear`` -- in that thread's CPU time
(``time.thread_time``), so the turns the scheduler gives to neighbours are not counted (in wall
time, at load 15-27 on the 2-vCPU VM, every start-up measurement was refused; in CPU time at load
12 the figures repeat within a few %). It takes the best of a few interleaved repetitions (what a
neighbour still costs, caches it evicted, only ever slows a run down), wants every non-default
choice confirmed by a second round, and trusts nothing it cannot: if the best tile reaches less
than 40% of the core's peak, the rate falls by more than 1.5x as rows grow, or the measurement
takes over ``TIME_LIMIT_S`` of CPU time (or ``WALL_LIMIT_S`` of wall time: a start-up must not
wait on a thrashing machine), the machine was too busy to tell; the defaults are used for this
process, logged, and nothing is cached. One shape stands for all (1536 x 576: SmolLM2-135M's hidden size into an MLP-wide output).
``PAGODA_CPU_GEMM_TUNE=0`` skips the measurement (8-row tiles, no F.linear rows, budget 512).
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform as host
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SHAPE = (1536, 576)  # out, in features of the measured product
TILE_ROWS = 512
ROWS = (64, 256, 512, 1024, 2048)
BUDGETS = (512, 1024, 2048)
DEFAULT_BUDGET = 512
TILE_MARGIN = 1.03  # a taller tile must be this much faster than 8 rows
ONEDNN_MARGIN = 1.10  # F.linear must be this much faster to take a row count
BUDGET_FRACTION = 0.90
REPEATS = 4
MAX_DROP = 1.5
MIN_PEAK_FRACTION = 0.40  # below this the core was shared too heavily to measure anything
TIME_LIMIT_S = 2.0  # of the thread's CPU time
WALL_LIMIT_S = 30.0
FORMAT = 3  # bump when the measurement changes meaning (3: thread CPU time, was wall time)


@dataclass(frozen=True)
class GemmTuning:
    dtype: str
    threads: int
    row_tile: int = 8
    # [lo, hi) row ranges F.linear serves; hi = 0 means no upper end
    onednn_rows: tuple[tuple[int, int], ...] = ()
    max_num_batched_tokens: int = DEFAULT_BUDGET
    # rows -> GFLOP/s, for the log and docs
    pagoda_gflops: dict[int, float] = field(default_factory=dict)
    f_linear_gflops: dict[int, float] = field(default_factory=dict)
    tile_gflops: dict[int, float] = field(default_factory=dict)
    measured: bool = False
    peak_gflops: float = 0.0  # one core's multiply-add peak, measured beside the rest
    reason: str = ""  # why the defaults are in use, when they are

    def uses_onednn(self, rows: int) -> bool:
        return any(lo <= rows and (hi == 0 or rows < hi) for lo, hi in self.onednn_rows)

    def describe(self) -> str:
        if not self.measured:
            return f"packed matmul {self.dtype}: defaults (8-row tiles, step budget {DEFAULT_BUDGET}): {self.reason}"
        curve = ", ".join(
            f"{r}: {self.pagoda_gflops[r]:.0f}/{self.f_linear_gflops[r]:.0f}" for r in sorted(self.pagoda_gflops)
        )
        tiles = ", ".join(f"{t}: {g:.0f}" for t, g in sorted(self.tile_gflops.items()))
        onednn = ", ".join(f"{lo}-{hi - 1 if hi else 'up'}" for lo, hi in self.onednn_rows) or "none"
        return (f"packed matmul {self.dtype}, one core in its CPU time (peak {self.peak_gflops:.0f} GFLOP/s): row tile {self.row_tile} (GFLOP/s at "
                f"{TILE_ROWS} rows by tile {tiles}); GFLOP/s pagoda/F.linear by rows {curve}; F.linear takes rows "
                f"{onednn}; step budget {self.max_num_batched_tokens} tokens")


def _best_seconds(fns: dict[Any, Callable[[], Any]], repeats: int) -> dict[Any, float]:
    for fn in fns.values():
        fn()  # warm-up: first-touch allocations, oneDNN's primitive cache
    times: dict[Any, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved: a noisy neighbour hits every candidate alike
            start = time.thread_time()
            fn()
            times[name].append(time.thread_time() - start)
    return {name: min(ts) for name, ts in times.items()}


def _ranges(rows: tuple[int, ...], chosen: set[int]) -> tuple[tuple[int, int], ...]:
    """Row ranges around the measured points in ``chosen``; boundaries at geometric midpoints."""
    bounds = [0] + [int((a * b) ** 0.5) + 1 for a, b in zip(rows, rows[1:])] + [0]
    bounds[0] = max(1, rows[0] * 3 // 4)  # never below the smallest measured row count: decode stays packed
    out: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        if r not in chosen:
            continue
        lo, hi = bounds[i], bounds[i + 1]
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


class TooBusy(RuntimeError):
    """The machine was too busy for the measurement to mean anything."""


def measure(dtype: torch.dtype, repeats: int = REPEATS, time_limit_s: float = TIME_LIMIT_S) -> GemmTuning:
    """Run the measurement on one thread (torch's thread count is restored afterwards); TooBusy if it cannot be trusted."""
    from pagoda_platform_cpu.gemm import ROW_TILES, PackedGemmKernel, measure_peak_gflops_thread_time

    started, started_wall = time.thread_time(), time.perf_counter()

    def check_time() -> None:
        if time.thread_time() - started > time_limit_s:
            raise TooBusy(f"the measurement took over {time_limit_s:.1f} s of CPU time")
        if time.perf_counter() - started_wall > WALL_LIMIT_S:
            raise TooBusy(f"the measurement took over {WALL_LIMIT_S:.0f} s of wall time")

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = max(measure_peak_gflops_thread_time(dtype) for _ in range(5))
        gen = torch.Generator().manual_seed(0)
        n, k = SHAPE
        weight = torch.randn(n, k, generator=gen).div_(k**0.5).to(dtype)
        kernels = {tile: PackedGemmKernel((dtype,), row_tile=tile) for tile in ROW_TILES}
        packed = kernels[8].prepare(weight)
        xs = {rows: torch.randn(rows, k, generator=gen).to(dtype) for rows in ROWS}

        def gflops(rows: int, seconds: float) -> float:
            return 2.0 * rows * n * k / seconds / 1e9

        x = xs[TILE_ROWS]
        tiles = {tile: (lambda kern=kern: kern.apply(x, packed, None)) for tile, kern in kernels.items()}
        tile_s = _best_seconds(tiles, repeats)
        best = min(tile_s, key=lambda t: tile_s[t])
        if gflops(TILE_ROWS, tile_s[best]) < MIN_PEAK_FRACTION * peak:
            raise TooBusy(f"the matmul reached {gflops(TILE_ROWS, tile_s[best]):.0f} of the core's {peak:.0f} GFLOP/s")
        row_tile = 8
        if tile_s[8] >= TILE_MARGIN * tile_s[best]:  # a taller tile must win a second, separate round too
            again = _best_seconds({8: tiles[8], best: tiles[best]}, repeats)
            row_tile = best if again[8] >= TILE_MARGIN * again[best] else 8
        chosen = kernels[row_tile]

        def compare(rows: int) -> tuple[float, float]:
            xr = xs[rows]
            s = _best_seconds(
                {"pagoda": lambda: chosen.apply(xr, packed, None), "f_linear": lambda: F.linear(xr, weight)}, repeats
            )
            return gflops(rows, s["pagoda"]), gflops(rows, s["f_linear"])

        pagoda: dict[int, float] = {}
        onednn: dict[int, float] = {}
        for rows in ROWS:
            check_time()
            pagoda[rows], onednn[rows] = compare(rows)
        # A real curve rises and levels off (the row blocks past L2 cost a little); a fall by more
        # than MAX_DROP between row counts means neighbours took the core during part of the sweep.
        for i, rows in enumerate(ROWS[1:], 1):
            earlier = max(pagoda[r] for r in ROWS[:i])
            if earlier > MAX_DROP * pagoda[rows]:
                raise TooBusy(f"pagoda's rate fell from {earlier:.0f} to {pagoda[rows]:.0f} GFLOP/s at {rows} rows")
        onednn_points = set()
        for rows in ROWS:  # oneDNN takes a row count only if it wins twice
            if onednn[rows] >= ONEDNN_MARGIN * pagoda[rows]:
                check_time()
                p2, o2 = compare(rows)
                if o2 >= ONEDNN_MARGIN * p2:
                    onednn_points.add(rows)
        check_time()
        served = {r: onednn[r] if r in onednn_points else pagoda[r] for r in ROWS}
        top = max(served[b] for b in BUDGETS)
        budget = next(b for b in BUDGETS if served[b] >= BUDGET_FRACTION * top)
        return GemmTuning(
            dtype=str(dtype).removeprefix("torch."), threads=1, row_tile=row_tile,
            onednn_rows=_ranges(ROWS, onednn_points), max_num_batched_tokens=budget,
            pagoda_gflops=pagoda, f_linear_gflops=onednn,
            tile_gflops={t: gflops(TILE_ROWS, s) for t, s in tile_s.items()}, measured=True, peak_gflops=peak,
        )
    finally:
        torch.set_num_threads(before)


def _cpu_identity() -> str:
    model = ""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        model = host.processor()
    return f"{model}|{flags}"


def _cache_path(dtype: torch.dtype) -> Path | None:
    from pagoda.disk_cache import cache_root

    root = cache_root()
    if root is None:
        return None
    source = resources.files("pagoda_platform_cpu").joinpath("csrc/gemm.cpp").read_bytes()
    key = hashlib.sha256(
        b"|".join([
            _cpu_identity().encode(), str(dtype).encode(), torch.__version__.encode(),
            str(FORMAT).encode(), source,
        ])
    ).hexdigest()[:24]
    return root / "gemm_tuning" / f"{key}.json"


def _load(path: Path) -> GemmTuning | None:
    try:
        data = json.loads(path.read_text())
        data["onednn_rows"] = tuple(tuple(r) for r in data["onednn_rows"])
        for name in ("pagoda_gflops", "f_linear_gflops", "tile_gflops"):
            data[name] = {int(key): value for key, value in data[name].items()}
        return GemmTuning(**data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@cache
def tuning(dtype: torch.dtype) -> GemmTuning:
    """This CPU's choices for ``dtype``: from the disk cache, else measured now (and logged); once per process."""
    from pagoda import envs

    name = str(dtype).removeprefix("torch.")
    if not envs.PAGODA_CPU_GEMM_TUNE:
        return GemmTuning(dtype=name, threads=1, reason="PAGODA_CPU_GEMM_TUNE=0")
    path = _cache_path(dtype)
    cached = _load(path) if path is not None and path.exists() else None
    if cached is not None:
        logger.info("%s (measured earlier on this CPU: %s)", cached.describe(), path)
        return cached
    try:
        result = measure(dtype)
    except TooBusy as exc:
        result = GemmTuning(dtype=name, threads=1, reason=f"the start-up measurement was not trusted ({exc}); not cached")
        logger.warning("%s", result.describe())
        return result
    logger.info("%s (measured at start-up)", result.describe())
    if path is not None:
        from pagoda.disk_cache import atomic_write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(result)))
    return result
