"""The int8 W8A8 matmul (pagoda-quant-compressed-tensors) beside the CPU platform's float matmul, same weights, interleaved.

usage: python -m benchmarks.int8_matmul [--reps 40]

Shapes of the benchmark model in benchmarks.quant_int8_fp8kv (hidden 1024): qkv 1536x1024, gate_up
8192x1024, down 1024x4096; rows 1 (decode), 8, 64, 256. Each figure is the fastest of ``reps`` calls
(the minimum filters the other sessions' load on a shared machine); the int8 time includes quantizing
the activations per token and the float32 output.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    from pagoda.layers import Linear, prepare_linear_layers
    from pagoda.platforms import current_platform
    from pagoda_quant_compressed_tensors import kernels

    platform = current_platform()
    print(f"# int8 path: {kernels.describe()}; load average {os.getloadavg()}")
    print("| N x K | rows | int8 ms | fp32 ms | bf16 ms | fp32 / int8 | bf16 / int8 |")
    print("|---|---|---|---|---|---|---|")

    def fastest(*fns: Callable[[], object]) -> list[float]:
        """The fastest of ``reps`` calls of each, the calls alternating (load changes hit all alike)."""
        for fn in fns:
            fn()
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(args.reps):
            for fn, out in zip(fns, times):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
        return [min(t) for t in times]

    torch.manual_seed(0)
    for n, k in ((1536, 1024), (8192, 1024), (1024, 4096)):
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n) * 0.01 + 1e-3
        int8 = kernels.W8A8Weight.prepare(w, scale, on_cpu=True)
        floats = {}
        for dtype in (torch.float32, torch.bfloat16):
            layer = Linear(k, n, bias=False, dtype=dtype)
            layer.weight.data = (w.float() * scale[:, None]).to(dtype)
            kernel = platform.linear_kernel(dtype)
            if kernel is not None:
                prepare_linear_layers(layer, kernel)
            floats[dtype] = layer
        for m in (1, 8, 64, 256):
            x32 = torch.randn(m, k)
            x16 = x32.to(torch.bfloat16)
            ti, t32, t16 = fastest(partial(int8.matmul, x32, None), partial(floats[torch.float32], x32),
                                   partial(floats[torch.bfloat16], x16))
            print(f"| {n} x {k} | {m} | {ti * 1e3:.3f} | {t32 * 1e3:.3f} | {t16 * 1e3:.3f} | {t32 / ti:.2f} | {t16 / ti:.2f} |",
                  flush=True)
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
