"""The CPU matmul table: pagoda's packed matmul vs oneDNN (F.linear and its packed form) vs the CPU's peak.

    python -m benchmarks.matmul_table [--rows 1,4,...] [--dtypes float32,bfloat16] [--repeats 5] [--cpu-time]

SmolLM2-135M's four decoder linears as pagoda runs them (fused qkv 960 x 576, o_proj 576 x 576,
fused gate_up 3072 x 576, down 576 x 1536), each of ``--layers`` decoder layers with weights of
its own so a few-row product reads them from memory as a decode step does (30 layers = the whole
model, used up to 64 rows; fewer above, where the product is compute-bound and a repetition must
stay short). The LM head (49152 x 576) is its own column group. Every implementation runs the
same inputs, interleaved within each repetition; a figure is the median over repetitions of the
whole set's FLOPs / time (GFLOP/s), or ms for the set at few rows. The peak is measured by the
gemm library's register-only FMA loop (``pagoda_gemm_peak``) on the same threads.

The machine is shared: compare columns of one run, never across runs. ``--cpu-time`` (one thread
only) times everything, the peak loop included, in the calling thread's CPU time
(``time.thread_time``, CLOCK_THREAD_CPUTIME_ID) instead of wall time, and takes the fastest
repetition: time the scheduler gives to neighbours is not counted, so "% of peak" means something on
a loaded machine (what neighbours still cost, evicted caches, is only ever added, hence the minimum).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

DECODER_SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = {"lm_head": (49152, 576)}
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _layers_for(rows: int, full: int) -> int:
    # Cold weights where reading them is the cost; above 64 rows a few layers keep a repetition short.
    return full if rows <= 64 else max(2, full * 64 // rows)


_clock: Callable[[], float] = time.perf_counter
_summary: Callable[[list[float]], float] = statistics.median


def _time(fn: Callable[[], Any]) -> float:
    start = _clock()
    fn()
    return _clock() - start


def use_cpu_time() -> None:
    """Time in the calling thread's CPU time, fastest repetition (needs one torch / kernel thread)."""
    global _clock, _summary
    if torch.get_num_threads() != 1:
        raise ValueError("--cpu-time measures the calling thread only: run it with --threads 1")
    _clock, _summary = time.thread_time, min


def measure(rows_list: list[int], dtype: torch.dtype, shapes: dict[str, tuple[int, int]], layers: int,
            repeats: int) -> list[dict[str, Any]]:
    from pagoda_platform_cpu.gemm import PackedGemmKernel
    from pagoda_platform_cpu.linear import OneDNNLinearKernel

    pagoda = PackedGemmKernel((dtype,))
    onednn = OneDNNLinearKernel((dtype,))
    gen = torch.Generator().manual_seed(0)
    weights = [
        [torch.randn(n, k, generator=gen).div_(k**0.5).to(dtype) for (n, k) in shapes.values()] for _ in range(layers)
    ]
    packed = [[pagoda.prepare(w) for w in layer] for layer in weights]
    reordered = [[onednn.prepare(w) for w in layer] for layer in weights]
    table = []
    for rows in rows_list:
        use = min(layers, _layers_for(rows, layers))
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for (_, k) in shapes.values()}
        flops = 2.0 * rows * use * sum(n * k for (n, k) in shapes.values())

        def run_pagoda(use: int = use, xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in packed[:use]:
                for p in layer:
                    pagoda.apply(xs[p.in_features], p, None)

        def run_f_linear(use: int = use, xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in weights[:use]:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        def run_onednn_packed(use: int = use, xs: dict[int, torch.Tensor] = xs) -> None:
            for layer, plain in zip(reordered[:use], weights[:use]):
                for r, w in zip(layer, plain):
                    onednn.apply(xs[w.shape[1]], r, None)

        impls = {"pagoda": run_pagoda, "f_linear": run_f_linear, "onednn_packed": run_onednn_packed}
        for fn in impls.values():  # warm-up: first-call allocations, oneDNN's primitive cache
            fn()
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(repeats):
            for name, fn in impls.items():
                times[name].append(_time(fn))
        row: dict[str, Any] = {"rows": rows, "layers": use, "gflop": flops / 1e9}
        for name, ts in times.items():
            med = _summary(ts)
            row[f"{name}_ms"] = med * 1e3
            row[f"{name}_gflops"] = flops / med / 1e9
        table.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return table


def measure_peak(dtype: torch.dtype, threads: int) -> float:
    from pagoda_platform_cpu.gemm import measure_peak_gflops, measure_peak_gflops_thread_time

    if _clock is time.perf_counter:
        return max(measure_peak_gflops(dtype, threads) for _ in range(5))
    return max(measure_peak_gflops_thread_time(dtype, 20_000_000) for _ in range(5))


def markdown(tables: dict[str, list[dict[str, Any]]], peaks: dict[str, float]) -> str:
    lines = []
    for key, table in tables.items():
        dtype = key.split("/")[0]
        peak = peaks[dtype]
        lines.append(f"\n{key} (peak {peak:.0f} GFLOP/s)\n")
        lines.append("| rows | pagoda | oneDNN F.linear | oneDNN packed | pagoda / best oneDNN | pagoda % of peak |")
        lines.append("|---|---|---|---|---|---|")
        for r in table:
            best = max(r["f_linear_gflops"], r["onednn_packed_gflops"])
            if r["rows"] <= 4:
                cells = [f"{r['pagoda_ms']:.2f} ms", f"{r['f_linear_ms']:.2f} ms", f"{r['onednn_packed_ms']:.2f} ms"]
            else:
                cells = [f"{r['pagoda_gflops']:.0f}", f"{r['f_linear_gflops']:.0f}", f"{r['onednn_packed_gflops']:.0f}"]
            lines.append(f"| {r['rows']} | " + " | ".join(cells)
                         + f" | {r['pagoda_gflops'] / best:.2f} | {100 * r['pagoda_gflops'] / peak:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lm-head", action="store_true", help="also the LM head (49152 x 576)")
    parser.add_argument("--threads", type=int, help="torch / kernel threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in the thread's CPU time, fastest repetition (needs --threads 1)")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.cpu_time:
        use_cpu_time()
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    clock = "thread CPU time, fastest" if args.cpu_time else "wall time, median"
    print(f"threads {threads}, {clock} of {args.repeats}, load average {os.getloadavg()}", flush=True)
    peaks = {name: measure_peak(dtypes[name], threads) for name in args.dtypes.split(",")}
    print(f"peak GFLOP/s: {peaks}", flush=True)
    tables = {}
    for name in args.dtypes.split(","):
        tables[f"{name}/decoder"] = measure(rows, dtypes[name], DECODER_SHAPES, args.layers, args.repeats)
        if args.lm_head:
            tables[f"{name}/lm_head"] = measure(rows, dtypes[name], LM_HEAD, 1, args.repeats)
    print(f"load average {os.getloadavg()}")
    print(markdown(tables, peaks))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"threads": threads, "peaks": peaks, "tables": tables}, f, indent=1)


if __name__ == "__main__":
    main()
