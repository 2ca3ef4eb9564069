"""Decode-sized matmuls as weight streaming: pagoda's packed matmul at 1-4 rows vs a plain sequential read.

    python -m benchmarks.decode_bandwidth [--threads 1] [--rows 1] [--repeats 15]

All 30 layers of SmolLM2-135M's decoder linears (qkv 960 x 576, o_proj 576 x 576, gate_up 3072 x 576,
down 576 x 1536), each with weights of its own (425 MB fp32, 212 MB bf16: far past L3, as in a decode
step), multiplied by ``--rows`` rows, against ``torch.sum`` over a float32 buffer of the same bytes
(the memory's plain sequential read on the same threads). GB/s = packed bytes / time; best and median
of interleaved repetitions, and their ratio, which is what the issue's 90% target is about.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def measure(dtype: torch.dtype, rows: int, repeats: int, layers: int = 30) -> dict[str, float]:
    from pagoda_platform_cpu.gemm import PackedGemmKernel

    kernel = PackedGemmKernel((dtype,))
    packed = [[kernel.prepare(torch.randn(n, k).to(dtype)) for n, k in SHAPES] for _ in range(layers)]
    nbytes = sum(p.packed.numel() * p.packed.element_size() for layer in packed for p in layer)
    xs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}
    buf = torch.ones(nbytes // 4, dtype=torch.float32)

    def matmul() -> None:
        for layer in packed:
            for p in layer:
                kernel.apply(xs[p.in_features], p, None)

    times: dict[str, list[float]] = {"matmul": [], "read": []}
    for _ in range(repeats):
        for name, fn in (("matmul", matmul), ("read", lambda: buf.sum())):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    out = {"mbytes": nbytes / 1e6}
    for name, ts in times.items():
        out[f"{name}_best_gbs"] = nbytes / min(ts) / 1e9
        out[f"{name}_median_gbs"] = nbytes / statistics.median(ts) / 1e9
    out["ratio_best"] = out["matmul_best_gbs"] / out["read_best_gbs"]
    out["ratio_median"] = out["matmul_median_gbs"] / out["read_median_gbs"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.dtypes.split(","):
        result = measure(getattr(torch, name), args.rows, args.repeats)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in result.items())
        print(f"{name}, {torch.get_num_threads()} threads, {args.rows} rows: {shown}; load {os.getloadavg()[0]:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
