"""The GPTQ 8-bit CPU kernel (pagoda-quant-gptq-awq) beside F.linear on the same weights dequantized and
beside the torch reference it replaces (the checkpoint dequantized at every call), interleaved.

usage: python -m benchmarks.int8_gptq_matmul [--reps 20] [--group 128] [--threads 1]

Shapes of a hidden-1024 Llama (as benchmarks.int4_matmul): qkv 1536x1024, gate_up 8192x1024, down
1024x4096, groups of 128 input channels, asymmetric zeros. For each row count the kernel runs four
ways -- int16 activations through VNNI's word dot products (``int16``: what ``auto`` runs with AVX512-VNNI),
bytes widened to float in registers (``float``: the AVX-512 path), int8 activations through VNNI's byte dot
products (``int8``, opt-in), and slabs of columns widened to float32 then torch's float matmul (``slab``) -- beside F.linear on the float32 weight, the CPU platform's packed float32 matmul (pagoda's
default for float layers) and the previous reference path. Each figure is the
fastest of ``reps`` calls, the calls alternating (the minimum filters the other sessions' load), each
from flushed caches (``--warm``: from warm ones).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] bytes -> GPTQ's [K / 4, N] int32, row 4 i + j in byte j of row i."""
    words = torch.zeros(q.shape[0] // 4, q.shape[1], dtype=torch.int64)
    for j in range(4):
        words |= q[j::4].long() << (8 * j)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _reference(x: torch.Tensor, ckpt: object) -> torch.Tensor:
    """The path 8-bit GPTQ layers took on CPU before the kernel: the checkpoint dequantized at every call."""
    from pagoda_quant_gptq_awq.formats import dequantize

    return F.linear(x, dequantize(ckpt))  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    parser.add_argument("--warm", action="store_true", help="time each call right after an untimed one (weights in cache)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagoda.layers import Linear, prepare_linear_layers
    from pagoda.platforms import current_platform
    from pagoda_quant_gptq_awq import cpu_int8_kernel
    from pagoda_quant_gptq_awq.formats import PackedCheckpoint, dequantize

    lib = cpu_int8_kernel.library()
    assert lib is not None, cpu_int8_kernel.describe()
    threads = torch.get_num_threads()
    flags = open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n", 1)[0].split()
    wanted = [f for f in flags if f.startswith(("avx", "fma"))]
    print(f"# {cpu_int8_kernel.describe()}; {threads} threads; {'warm' if args.warm else 'cold'} caches; "
          f"load average {os.getloadavg()}; flags {' '.join(wanted)}")
    print("| N x K | rows | int16 ms | float ms | int8 ms | slab ms | F.linear fp32 ms | platform fp32 ms | reference ms "
          "| F.linear / int16 | platform / int16 | reference / int16 | int16 / float | int8 / float |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    # Every call starts from the same cache state, else the call after the reference's (which streams tens of
    # MB) pays for the weights the next calls find warm: cold (the caches flushed by 64 MB of writes; a decode
    # step's weights come from DRAM once the model outgrows the L3) or, with --warm, each call run once first.
    flush = torch.zeros(16 << 20)

    def fastest(*fns: Callable[[], object]) -> list[float]:
        for fn in fns:
            fn()
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(args.reps):
            for fn, out in zip(fns, times):
                if args.warm:
                    fn()
                else:
                    flush.add_(1.0)
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
        return [min(t) for t in times]

    torch.manual_seed(0)
    avx512, vnni, int16 = (cpu_int8_kernel.PATHS[p] for p in ("avx512", "vnni512", "vnni512_int16"))
    for n, k in ((1536, 1024), (8192, 1024), (1024, 4096)):
        groups = k // args.group
        q = torch.randint(0, 256, (k, n), dtype=torch.uint8)
        zeros = torch.randint(1, 256, (groups, n))
        scales = (torch.rand(groups, n) * 0.001 + 1e-4).half()
        g = torch.arange(k) // args.group
        weight8 = cpu_int8_kernel.CpuInt8Weight.prepare(q, zeros.float(), scales.float(), g, lib)
        # the checkpoint as GPTQ v1 stores it (zeros minus one), for the reference path
        qzeros = _pack_rows((zeros - 1).t().contiguous()).t().contiguous()
        ckpt = PackedCheckpoint("gptq", _pack_rows(q), qzeros, scales, g.to(torch.int32), args.group, 1, k, n, 8)
        ckpt.validate("bench")
        weight = dequantize(ckpt)
        layer = Linear(k, n, bias=False, dtype=torch.float32)  # pagoda's packed fp32 matmul, its float layers' default
        layer.weight.data = weight.clone()
        kernel = current_platform().linear_kernel(torch.float32)
        if kernel is not None:
            prepare_linear_layers(layer, kernel)
        for m in args.rows:
            x = torch.randn(m, k)
            t_16, t_reg, t_vnni, t_slab, t_lin, t_plat, t_ref = fastest(
                partial(weight8.in_register_matmul, x, None, lib, threads, int16),
                partial(weight8.in_register_matmul, x, None, lib, threads, avx512),
                partial(weight8.in_register_matmul, x, None, lib, threads, vnni),
                partial(weight8.slab_matmul, x, None, lib, threads),
                partial(F.linear, x, weight),
                partial(layer, x),
                partial(_reference, x, ckpt))
            print(f"| {n} x {k} | {m} | {t_16 * 1e3:.3f} | {t_reg * 1e3:.3f} | {t_vnni * 1e3:.3f} | "
                  f"{t_slab * 1e3:.3f} | {t_lin * 1e3:.3f} | {t_plat * 1e3:.3f} | {t_ref * 1e3:.2f} | "
                  f"{t_lin / t_16:.2f} | {t_plat / t_16:.2f} | {t_ref / t_16:.1f} | {t_16 / t_reg:.2f} | "
                  f"{t_vnni / t_reg:.2f} |", flush=True)
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
