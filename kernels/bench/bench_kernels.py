"""Benchmark and check pagoda's Triton kernels.

On a GPU:
  * paged decode attention's achieved memory bandwidth (K/V bytes read per second)
    at long contexts, next to a measured device-to-device copy (the practical
    ceiling), for a Llama-3-8B-like head layout (32 query / 8 KV heads, head_dim 128, bf16);
  * chunked-prefill attention throughput;
  * every kernel against its torch reference at real sizes.
Without a GPU it runs the correctness part on tiny shapes under Triton's
interpreter, so the script itself stays testable anywhere.

    python kernels/bench/bench_kernels.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # Must precede the first import of the Triton kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda_kernels import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    reshape_and_cache,
    reshape_and_cache_torch,
    rotary_embedding,
    rotary_embedding_torch,
    silu_and_mul,
    silu_and_mul_torch,
)
from pagoda_kernels.testing import make_paged_batch  # noqa: E402

GB = 1e9


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


GPU_SHAPE = Shape(32, 8, 128, 16, torch.bfloat16)
CPU_SHAPE = Shape(4, 2, 16, 4, torch.float32)


def time_gpu(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Device-to-device copy: (read + write) bytes per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_gpu(lambda: dst.copy_(src), iters)
    return 2 * nbytes / seconds


def bench_decode(contexts: list[tuple[int, int]], iters: int, copy_bw: float) -> list[list[str]]:
    s = GPU_SHAPE
    elem = torch.tensor([], dtype=s.dtype).element_size()
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch_size, context in contexts:
        batch = make_paged_batch([context] * batch_size, [1] * batch_size, s.num_kv_heads, s.head_dim,
                                 s.block_size, s.dtype, "cuda", generator=g)
        query = torch.randn(batch_size, s.num_heads, s.head_dim, generator=g).to("cuda", s.dtype)
        args = (query, batch.kv_cache, batch.block_tables, batch.seq_lens, s.head_dim**-0.5)
        max_seq_len = batch.max_seq_len
        seconds = time_gpu(lambda a=args, m=max_seq_len: paged_decode_attention(*a, max_seq_len=m), iters)
        kv_bytes = 2 * batch_size * context * s.num_kv_heads * s.head_dim * elem
        io_bytes = kv_bytes + 2 * query.numel() * elem
        bw = io_bytes / seconds
        from pagoda_kernels.triton_impl.decode import choose_num_splits

        splits = choose_num_splits(batch_size, s.num_kv_heads, context, query.device)
        rows.append([str(batch_size), str(context), str(splits), f"{seconds * 1e6:.1f}", f"{bw / GB:.0f}",
                     f"{100 * bw / copy_bw:.0f}%"])
        del batch, args
        torch.cuda.empty_cache()
    return rows


def bench_prefill(lengths: list[int], iters: int) -> list[list[str]]:
    s = GPU_SHAPE
    rows = []
    g = torch.Generator().manual_seed(1)
    for length in lengths:
        batch = make_paged_batch([length], [length], s.num_kv_heads, s.head_dim, s.block_size, s.dtype, "cuda",
                                 generator=g)
        query = torch.randn(length, s.num_heads, s.head_dim, generator=g).to("cuda", s.dtype)
        args = (query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, s.head_dim**-0.5)
        seconds = time_gpu(lambda a=args, n=length: paged_prefill_attention(*a, max_query_len=n), iters)
        # Causal: half of the L x L score matrix; 2 matmuls of 2 flops per multiply-add.
        flops = 2 * 2 * s.num_heads * s.head_dim * length * length / 2
        rows.append([str(length), f"{seconds * 1e3:.2f}", f"{flops / seconds / 1e12:.1f}"])
    return rows


def check_correctness(device: str, small: bool) -> list[list[str]]:
    """Each kernel vs its torch reference; bf16 on GPU, fp32 under the interpreter."""
    s = CPU_SHAPE if small else GPU_SHAPE
    impl = "triton"
    tol = {"rtol": 1e-4, "atol": 1e-5} if s.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    g = torch.Generator().manual_seed(2)
    rows: list[list[str]] = []

    def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        try:
            torch.testing.assert_close(got, want, **tol)
            verdict = "ok"
        except AssertionError:
            verdict = "FAIL"
        rows.append([name, str(s.dtype).removeprefix("torch."), f"{err:.2e}", verdict])

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, s.dtype)

    seq_lens, query_lens = ([40, 13, 5], [1, 6, 5]) if small else ([9000, 1300, 64, 3000], [1, 300, 64, 1])
    batch = make_paged_batch(seq_lens, query_lens, s.num_kv_heads, s.head_dim, s.block_size, s.dtype, device,
                             generator=g)
    k, v = rand(batch.num_tokens, s.num_kv_heads, s.head_dim), rand(batch.num_tokens, s.num_kv_heads, s.head_dim)
    want_cache = batch.kv_cache.clone()
    reshape_and_cache(k, v, batch.kv_cache, batch.slot_mapping, impl=impl)
    reshape_and_cache_torch(k, v, want_cache, batch.slot_mapping)
    record("reshape_and_cache", batch.kv_cache, want_cache)

    scale = s.head_dim**-0.5
    q = rand(batch.num_tokens, s.num_heads, s.head_dim)
    pre_args = (q, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)
    for name, extra in [("prefill", {}), ("prefill window", {"sliding_window": 7 if small else 1024}),
                        ("prefill softcap", {"soft_cap": 30.0})]:
        got = paged_prefill_attention(*pre_args, **extra, max_query_len=batch.max_query_len, impl=impl)
        record(name, got, paged_prefill_attention_torch(*pre_args, **extra))

    dq = rand(len(seq_lens), s.num_heads, s.head_dim)
    dec_args = (dq, batch.kv_cache, batch.block_tables, batch.seq_lens, scale)
    for splits in (1, 4):
        got = paged_decode_attention(*dec_args, num_splits=splits, impl=impl)
        record(f"decode splits={splits}", got, paged_decode_attention_torch(*dec_args))

    hidden = 40 if small else 4096
    x, r, w = rand(7, hidden), rand(7, hidden), rand(hidden)
    for name, got, want in zip(("rms+residual", "residual sum"), fused_add_rms_norm(x, r, w, impl=impl),
                               fused_add_rms_norm_torch(x, r, w, 1e-6), strict=True):
        record(name, got, want)

    rot = s.head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    positions = torch.randint(0, 64, (9,), generator=g).to(device)
    rq, rk = rand(9, s.num_heads * s.head_dim), rand(9, s.num_kv_heads * s.head_dim)
    got_q, got_k = rotary_embedding(positions, rq, rk, s.head_dim, cos_sin, impl=impl)
    want_q, want_k = rotary_embedding_torch(positions, rq, rk, s.head_dim, cos_sin)
    record("rotary q", got_q, want_q)
    record("rotary k", got_k, want_k)

    y = rand(5, 2 * (70 if small else 14336))
    record("silu_and_mul", silu_and_mul(y, impl=impl), silu_and_mul_torch(y))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    if HAS_GPU:
        device_name = torch.cuda.get_device_name()
        iters = 10 if args.quick else 50
        copy_bw = copy_bandwidth(1 << 30, iters)
        print(f"device: {device_name}; device-to-device copy: {copy_bw / GB:.0f} GB/s (read + write)")
        contexts = [(1, 32768), (8, 8192), (64, 4096)] if args.quick else [
            (1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (32, 16384), (64, 4096), (256, 2048)]
        print_table("paged decode attention (32 q / 8 kv heads, head_dim 128, bf16, block 16)",
                    ["batch", "context", "splits", "us", "GB/s", "of copy"], bench_decode(contexts, iters, copy_bw))
        lengths = [2048] if args.quick else [512, 2048, 8192]
        print_table("prefill attention (one causal sequence)", ["tokens", "ms", "TFLOP/s"], bench_prefill(lengths, iters))
        rows = check_correctness("cuda", small=False)
    else:
        print("device: none (no CUDA/ROCm GPU): bandwidth skipped; correctness under TRITON_INTERPRET=1 on tiny shapes")
        rows = check_correctness("cpu", small=True)
    print_table("correctness vs torch reference", ["kernel", "dtype", "max abs err", "result"], rows)
    print(f"\n({time.perf_counter() - started:.1f} s)")
    return 1 if any(r[-1] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
