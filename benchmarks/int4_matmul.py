"""The GPTQ / AWQ 4-bit CPU kernel (pagoda-quant-gptq-awq) beside F.linear on the same weights dequantized, interleaved.

usage: python -m benchmarks.int4_matmul [--reps 30] [--group 128]

Shapes of a hidden-1024 Llama (benchmarks.quant_int8_fp8kv's model): qkv 1536x1024, gate_up
8192x1024, down 1024x4096, groups of 128 input channels. For each row count the 4-bit kernel runs
both ways -- nibbles widened in registers (``in-reg``) and slabs of columns widened to float32 then
torch's float matmul (``slab``) -- beside F.linear on the float32 weight it dequantizes to (and
the CPU platform's packed float32 matmul, pagoda's default for float layers). Each figure is the
fastest of ``reps`` calls, the calls alternating (the minimum filters the other sessions' load).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda.layers import Linear, prepare_linear_layers
    from pagoda.platforms import current_platform
    from pagoda_quant_gptq_awq import cpu_kernel

    lib = cpu_kernel.library()
    assert lib is not None, cpu_kernel.describe()
    platform = current_platform()
    threads = torch.get_num_threads()
    print(f"# {cpu_kernel.describe()}; {threads} threads; load average {os.getloadavg()}")
    print("| N x K | rows | int4 in-reg ms | int4 slab ms | F.linear fp32 ms | platform fp32 ms | F.linear / best int4 |")
    print("|---|---|---|---|---|---|---|")

    def fastest(*fns: Callable[[], object]) -> list[float]:
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
        groups = k // args.group
        q = torch.randint(0, 16, (k, n), dtype=torch.uint8)
        zeros = torch.randint(0, 16, (groups, n)).float()
        scales = (torch.rand(groups, n) * 0.01 + 1e-3).half().float()
        g = torch.arange(k) // args.group
        int4 = cpu_kernel.CpuInt4Weight.prepare(q, zeros, scales, g, lib)
        weight = ((q.float() - zeros[g]) * scales[g]).t().contiguous()
        layer = Linear(k, n, bias=False, dtype=torch.float32)
        layer.weight.data = weight.clone()
        kernel = platform.linear_kernel(torch.float32)
        if kernel is not None:
            prepare_linear_layers(layer, kernel)
        for m in args.rows:
            x = torch.randn(m, k)
            t_reg, t_slab, t_lin, t_plat = fastest(partial(int4.in_register_matmul, x, None, lib, threads),
                                                   partial(int4.slab_matmul, x, None, lib, threads),
                                                   partial(F.linear, x, weight), partial(layer, x))
            print(f"| {n} x {k} | {m} | {t_reg * 1e3:.3f} | {t_slab * 1e3:.3f} | {t_lin * 1e3:.3f} | "
                  f"{t_plat * 1e3:.3f} | {t_lin / min(t_reg, t_slab):.2f} |", flush=True)
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
