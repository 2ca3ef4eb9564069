"""The GGUF CPU kernel's decode GEMV (one activation row), variants interleaved in one run.

usage: python -m benchmarks.gguf_gemv [--reps 200] [--threads 1,2] [--types Q4_1,Q8_0,...]

Shapes of the shipped SmolLM2-135M Q4_1 file (hidden 576, intermediate 1536: qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536 in Q4_1, the tied head 49152x576 in Q8_0) on random blocks, and
3072x1536 for the K-quants (3072x576 for Q4_0, Q5_0, Q5_1). Per shape and thread count, the calls of every variant alternate and each
figure is the fastest of ``reps`` (the minimum filters other sessions' load on a shared machine):

- ``stored``: the kernel on the blocks as stored (activations quantized per block, integer dots);
- ``repacked``: the same on the repacked layout (4 rows' blocks interleaved, scales apart);
- ``f32-dequant``: Q4_1 only, weights dequantized in registers to float and multiplied with the float
  activations (the alternative the issue asks to measure; built here from ``_F32_DEQUANT``, 4 rows a
  pass like the stored kernel, 8-wide FMA);
- ``read``: ``torch.sum`` over a float32 buffer of the same bytes (also cold), the plain sequential
  read that ``benchmarks/decode_bandwidth.py`` compares against: the GEMV's ceiling;
- ``torch-dequant``: K-quants only, the weight dequantized per call in torch and ``F.linear`` (the
  path K-quant layers took before their kernel).

Every call reads its weights from memory, as decode does (the calls cycle through copies filling
128 MiB, past the caches). Prints µs per call and GB/s of weight bytes streamed, with the load average.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# Q4_1 GEMV with the weights dequantized in registers: for each 32-value block, its nibbles widened
# to float and multiplied into the float x; sum = d * dot(q, x) + m * sum(x).
_F32_DEQUANT = r"""
#include <immintrin.h>
#include <cstdint>
#include <cstring>
extern "C" void gemv_q4_1_f32(const uint8_t* w, int64_t N, int64_t K, const float* x, float* y, int threads) {
  const int64_t nb = K / 32, row_bytes = nb * 20;
  float* xsum = new float[nb];
  for (int64_t b = 0; b < nb; ++b) { float s = 0; for (int j = 0; j < 32; ++j) s += x[b * 32 + j]; xsum[b] = s; }
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N / 4 * 4; n += 4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float corr[4] = {0, 0, 0, 0};
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * 32;
      const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
                   x3 = _mm256_loadu_ps(xb + 24);
      for (int r = 0; r < 4; ++r) {
        const uint8_t* blk = w + (n + r) * row_bytes + b * 20;
        uint16_t dh, mh;
        std::memcpy(&dh, blk, 2);
        std::memcpy(&mh, blk + 2, 2);
        const float d = _cvtsh_ss(dh), m = _cvtsh_ss(mh);
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
        __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), x0);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), x1, s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), x2, s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), x3, s);
        acc[r] = _mm256_fmadd_ps(s, _mm256_set1_ps(d), acc[r]);
        corr[r] += m * xsum[b];
      }
    }
    for (int r = 0; r < 4; ++r) {
      __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
      v = _mm_hadd_ps(v, v);
      v = _mm_hadd_ps(v, v);
      y[n + r] = _mm_cvtss_f32(v) + corr[r];
    }
  }
  delete[] xsum;
}
"""


def _f32_dequant_library(folder: Path) -> ctypes.CDLL:
    source, library = folder / "f32_dequant.cpp", folder / "f32_dequant.so"
    source.write_text(_F32_DEQUANT)
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(library)],
                   check=True)
    lib = ctypes.CDLL(str(library))
    lib.gemv_q4_1_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int]
    return lib


def _blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    import gguf

    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    # finite f16 scales where each type keeps them (the quants may be any bytes)
    offsets = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}[qtype]
    for offset in offsets:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def _variants(qtype: int, n: int, k: int, threads: int, copies: list[torch.Tensor],
              f32: ctypes.CDLL) -> dict[str, Callable[[], object]]:
    """The variants' calls for one shape, each on the next cold copy of the weights."""
    from gguf import GGMLQuantizationType as Q

    from pagoda_quant_gguf import kernels
    from pagoda_quant_gguf.dequant import dequantize_blocks

    turn = iter(range(10**9))
    x = torch.randn(1, k)
    y = torch.empty(n)

    def cold(tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[next(turn) % len(tensors)]

    # the memory's plain sequential read of as many bytes (float32 ones: no denormal assists), on the same threads
    reads = [torch.ones(c.numel() // 4) for c in copies]
    fns: dict[str, Callable[[], object]] = {"stored": lambda: kernels.matmul(x, cold(copies), qtype, k),
                                            "read": lambda: cold(reads).sum()}
    packed = [kernels.repack(c, qtype, k) for c in copies]
    if packed[0] is not None:
        fns["repacked"] = lambda: kernels.matmul(x, cold(packed), qtype, k, packed=True)  # type: ignore[arg-type]
    if qtype == Q.Q4_1:
        fns["f32-dequant"] = lambda: f32.gemv_q4_1_f32(cold(copies).data_ptr(), n, k, x.data_ptr(), y.data_ptr(), threads)
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        fns["torch-dequant"] = lambda: F.linear(x, dequantize_blocks(cold(copies), qtype, k))
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K", help="GGML types to measure")
    args = parser.parse_args()
    from gguf import GGMLQuantizationType as Q

    from pagoda_quant_gguf import kernels

    def fastest(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.reps):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        return {name: min(t) for name, t in times.items()}

    print(f"# kernel: {kernels.describe()}; load average before {os.getloadavg()}")
    print("| type | N x K | threads | variant | µs | GB/s | stored / variant |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        f32 = _f32_dequant_library(Path(tmp))
        cases = [(Q.Q4_1, 960, 576), (Q.Q4_1, 576, 576), (Q.Q4_1, 3072, 576), (Q.Q4_1, 576, 1536),
                 (Q.Q8_0, 49152, 576), (Q.Q4_0, 3072, 576), (Q.Q5_0, 3072, 576), (Q.Q5_1, 3072, 576)]
        cases += [(t, 3072, 1536) for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)]
        for qtype, n, k in (c for c in cases if c[0].name in args.types.split(",")):
            # decode streams every weight from memory once a token (the model exceeds the caches): each
            # call takes the next of enough copies to pass 128 MiB, so none is still cached
            blocks = _blocks(int(qtype), n, k)
            copies = [blocks] + [blocks.clone() for _ in range(-(-128 * 2**20 // blocks.numel()) - 1)]
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                fns = _variants(int(qtype), n, k, threads, copies, f32)
                best = fastest(fns)
                for name, seconds in best.items():
                    print(f"| {qtype.name} | {n}x{k} | {threads} | {name} | {seconds * 1e6:.1f} | "
                          f"{blocks.numel() / seconds / 1e9:.2f} | {best['stored'] / seconds:.2f} |", flush=True)
    print(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
