// y[M, N] = x[M, K] W[N, K]^T (+ bias) on AVX-512, from a weight packed once into column panels.
//
// The weight is packed into panels of 32 output columns, each panel a run of k-steps of
// 32 columns: fp32 [ceil(N/32)][K][32][1]; bf16 [ceil(N/32)][ceil(K/2)][32][2], k in pairs
// because vdpbf16ps multiplies 16 pairs of bf16 and adds each pair's two products into one
// float32 lane (AVX512_BF16). Zero-padded. A panel's k-step is two 64-byte loads; a row of
// x contributes one broadcast per k-step (one float, or its two bf16 k values). A tile of up
// to 8 rows x 32 columns keeps 16 float32 accumulators in registers, so each weight load
// feeds 8 rows: compute-bound from ~8 rows up, and at 1-4 rows a single forward stream
// through the panel, which reads the weight faster than a row-at-a-time GEMV. Each thread
// takes a contiguous range of panels and runs every row tile over a panel while it sits in L2.
//
// Measured on the 2-vCPU Zen 4 VM (all 120 matrices of SmolLM2-135M, cold, ms or GFLOP/s):
//   bf16 vs oneDNN packed: 8 rows 239 vs 134 GFLOP/s, 16: 328 vs 216, 32: 384 vs 293,
//        64: 413 vs 339, 512: 445 vs 421; 1 row 6.95 ms vs the GEMV's 8.42.
//   fp32 vs oneDNN packed: 8 rows 133 vs 83, 32: 195 vs 165, 64: 193 vs 178, 512: 221 vs 220;
//        1 row 13.1 ms vs the GEMV's 16.4.
// On 2 Zen 5 cores (full 512-bit datapaths, SmolLM2's decoder matrices streamed from memory),
// pulling each thread's next panel into L2 while the current one's later row tiles compute
// (rows_by) took bf16 at 32 rows from 663 to 780-864 GFLOP/s and at 64 rows from 791-799 to
// 839-958 over several runs (docs/benchmarks.md, session 10).
// Accumulation is float32 (products of bf16 are exact in float32); bias is added in float32
// and a bf16 result rounded once, to nearest even.
//
// Entry points (extern "C", called through ctypes by pagoda_platform_cpu.gemm, which checks the
// arguments and allocates the outputs): pagoda_gemm_supports, pagoda_gemm_pack_{f32,bf16},
// pagoda_gemm_{f32,bf16}, pagoda_gemm_peak. dtype codes: 0 float32, 1 bfloat16. row_tile: 8, 12 or 14
// rows per register tile (anything else: 8).

#include <omp.h>
#include <unistd.h>
#include <pagoda/parallel.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGODA_GEMM_FP32 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_GEMM_BF16 1
#endif

namespace pagoda_gemm {

constexpr int64_t kPanel = 32;  // output columns per panel: two 16-lane float32 accumulators
constexpr int kRowTile = 8;     // rows per register tile: 16 accumulators + 2 weight + 1 x register

// Elements of x one k-step of a panel consumes: bf16 goes in pairs.
template <typename T>
constexpr int64_t kStep = sizeof(T) == 2 ? 2 : 1;

#if defined(PAGODA_GEMM_FP32)

PAGODA_INLINE __m512 weight_vector(const float* p) { return _mm512_loadu_ps(p); }
// x[k] for every lane; fp32 has no pairs, so `last` changes nothing.
PAGODA_INLINE __m512 x_broadcast(const float* x, bool /*last*/) { return _mm512_set1_ps(*x); }
PAGODA_INLINE __m512 madd(__m512 acc, __m512 a, __m512 w) { return _mm512_fmadd_ps(a, w, acc); }
PAGODA_INLINE void store_columns(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
PAGODA_INLINE void store_columns(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }

#if defined(PAGODA_GEMM_BF16)
PAGODA_INLINE __m512i weight_vector(const uint16_t* p) { return _mm512_loadu_si512(p); }
// x[k], x[k + 1] as one 32-bit lane pattern; for the lone last k of an odd K the partner weight
// is a zero pad, so the half-word beside x[k] must be zero too (NaN x 0 would be NaN).
PAGODA_INLINE __m512i x_broadcast(const uint16_t* x, bool last) {
  if (last) return _mm512_set1_epi32(static_cast<int32_t>(*x));
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(pair);
}
PAGODA_INLINE __m512 madd(__m512 acc, __m512i a, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w); }
PAGODA_INLINE void store_columns(uint16_t* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}
PAGODA_INLINE void store_columns(uint16_t* y, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// What a tile does with its sums. kSiluAndMul: the weight was packed with each panel's 32 columns
// 16 gate columns then the same 16 columns' up (pagoda_platform_cpu.gemm.PackedGemmKernel.
// prepare_silu_and_mul), and the tile writes silu(gate) * up, 16 columns a panel: the fused MLP's
// activation, rounded as the two separate ops round (the projection's result to T first, then
// pagoda::simd::silu_mul), so results are bit for bit theirs.
enum class Epilogue { kStore, kSiluAndMul };

// Cache lines of the next panel to pull in while a tile computes (see rows_by).
struct Prefetch {
  const char* from = nullptr;
  int64_t lines = 0;  // to prefetch, spread evenly over the tile's k-steps:
  int64_t per = 0;    // `per` lines every `steps` k-steps (at most 2 a k-step)
  int64_t steps = 1;
};

// Rows [0, MR) of x against one panel.
template <typename T, int MR, Epilogue E>
PAGODA_INLINE void tile(const T* x, int64_t ldx, int64_t K, const T* panel, const float* bias, T* y, int64_t ldy,
                        int64_t columns, Prefetch pf = {}) {
  __m512 acc[MR][2];
  // bias: padded to whole panels by the caller
  const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  constexpr int64_t step = kStep<T>;
  const int64_t full = K / step;
  int64_t credit = pf.steps - 1;  // the first k-step prefetches
  for (int64_t s = 0; s < full; ++s) {
    const auto w0 = weight_vector(panel + s * step * kPanel);
    const auto w1 = weight_vector(panel + s * step * kPanel + 16 * step);
    if (pf.lines > 0) {
      credit += pf.per;
      if (credit >= pf.steps) {
        credit -= pf.steps;
        _mm_prefetch(pf.from, _MM_HINT_T0);
        pf.from += 64;
        --pf.lines;
        if (credit >= pf.steps) {
          credit -= pf.steps;
          _mm_prefetch(pf.from, _MM_HINT_T0);
          pf.from += 64;
          --pf.lines;
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const auto a = x_broadcast(x + r * ldx + s * step, false);
      acc[r][0] = madd(acc[r][0], a, w0);
      acc[r][1] = madd(acc[r][1], a, w1);
    }
  }
  if (full * step < K) {  // bf16 with an odd K: the lone last k
    const auto w0 = weight_vector(panel + full * step * kPanel);
    const auto w1 = weight_vector(panel + full * step * kPanel + 16 * step);
    for (int r = 0; r < MR; ++r) {
      const auto a = x_broadcast(x + r * ldx + full * step, true);
      acc[r][0] = madd(acc[r][0], a, w0);
      acc[r][1] = madd(acc[r][1], a, w1);
    }
  }
  if constexpr (E == Epilogue::kSiluAndMul) {
    using Rounded = std::conditional_t<sizeof(T) == 2, pagoda::bf16, float>;  // what the projection stores
    const __mmask16 mask = columns >= 16 ? 0xffff : static_cast<__mmask16>((1u << columns) - 1);
    for (int r = 0; r < MR; ++r) {
      const auto gate = pagoda::simd::round_to<Rounded>(reinterpret_cast<pagoda::simd::vfloat>(acc[r][0]));
      const auto up = pagoda::simd::round_to<Rounded>(reinterpret_cast<pagoda::simd::vfloat>(acc[r][1]));
      store_columns(y + r * ldy, reinterpret_cast<__m512>(pagoda::simd::silu_mul<Rounded>(gate, up)), mask);
    }
    return;
  }
  if (columns == kPanel) {
    for (int r = 0; r < MR; ++r) {
      store_columns(y + r * ldy, acc[r][0]);
      store_columns(y + r * ldy + 16, acc[r][1]);
    }
    return;
  }
  const __mmask16 lo = columns >= 16 ? 0xffff : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 hi = columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  for (int r = 0; r < MR; ++r) {
    store_columns(y + r * ldy, acc[r][0], lo);
    store_columns(y + r * ldy + 16, acc[r][1], hi);
  }
}

// Rows [0, M) against one panel in tiles of MR rows; the last M % MR rows in tiles of at most 8.
// `next`: the panel this thread runs next (nullptr: none). Without help the first tile would
// stream the panel from memory and the others find it in cache, the memory idle while they
// compute (at 32 rows a third of the time: the same matmul ran at 663 GFLOP/s from memory and 921
// from L3 on 2 Zen 5 cores). So every tile pulls in its share of the next panel, spread evenly
// over its k-steps, and every panel after a thread's first arrives already cached. Measured on 2
// Zen 5 cores, SmolLM2's 120 decoder matrices from memory, against the earlier form (shares for
// the tiles after the first, a line a k-step from each tile's start, into L2): evenly spread
// gained most at 12-16 rows (f32 146 -> 215 GFLOP/s; the 2 tiles of 16 rows had left one tile
// prefetching a whole panel in bursts) and 8-13% at 64-128 rows; prefetcht0 rather than t1 gained
// another 9-13% at 32 rows (f32 430 -> 468, bf16 792 -> 899). At 1-3 rows the product is a
// memory stream the hardware prefetchers keep up with; a software stream beside it cost 9% at 1 row.
template <typename T, int MR, Epilogue E>
void rows_by(const T* x, int64_t ldx, int64_t M, int64_t K, const T* panel, const float* bias, T* y, int64_t ldy,
             int64_t columns, const T* next, int64_t next_lines) {
  constexpr int64_t step = kStep<T>;
  const int64_t steps = (K + step - 1) / step;  // a k-step of a panel is 128 bytes, 2 lines, in both dtypes
  // the tiles run below: whole MR-row tiles, an 8-row one when MR > 8 leaves more than 8, then the rest
  int64_t tiles = M / MR, rest = M % MR;
  if (MR > 8 && rest > 8) {
    ++tiles;
    rest -= 8;
  }
  if (rest > 0) ++tiles;
  const int64_t lines = next_lines, share = (lines + tiles - 1) / tiles;
  int64_t index = 0;
  auto prefetch = [&]() -> Prefetch {
    const int64_t t = index++;
    if (next == nullptr || share == 0 || M <= 3) return {};
    const int64_t first = t * share;
    if (first >= lines) return {};
    return {reinterpret_cast<const char*>(next) + first * 64, std::min(share, lines - first), share, steps};
  };
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    tile<T, MR, E>(x + m * ldx, ldx, K, panel, bias, y + m * ldy, ldy, columns, prefetch());
  }
  if (MR > 8 && M - m > 8) {
    tile<T, 8, E>(x + m * ldx, ldx, K, panel, bias, y + m * ldy, ldy, columns, prefetch());
    m += 8;
  }
  const T* xr = x + m * ldx;
  T* yr = y + m * ldy;
  if (M == m) return;
  const Prefetch pf = prefetch();
  switch (M - m) {
    case 1: tile<T, 1, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    case 2: tile<T, 2, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    case 3: tile<T, 3, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    case 4: tile<T, 4, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    case 5: tile<T, 5, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    case 6: tile<T, 6, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    case 7: tile<T, 7, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    case 8: tile<T, 8, E>(xr, ldx, K, panel, bias, yr, ldy, columns, pf); break;
    default: break;
  }
}

// The register tile's height is chosen per CPU (pagoda_platform_cpu.gemm_tuning measures them at
// start-up): taller tiles load each weight vector for more rows (8 rows: 2 weight loads a
// 16 multiply-adds; 12: 2 a 24; 14: 2 a 28, 31 of the 32 vector registers), which matters
// where two 512-bit multiply-adds issue a cycle and the panel streams from L2.
template <typename T, Epilogue E>
void rows(const T* x, int64_t ldx, int64_t M, int64_t K, const T* panel, const float* bias, T* y, int64_t ldy,
          int64_t columns, int row_tile, const T* next, int64_t next_lines) {
  switch (row_tile) {
    case 12: rows_by<T, 12, E>(x, ldx, M, K, panel, bias, y, ldy, columns, next, next_lines); break;
    case 14: rows_by<T, 14, E>(x, ldx, M, K, panel, bias, y, ldy, columns, next, next_lines); break;
    default: rows_by<T, kRowTile, E>(x, ldx, M, K, panel, bias, y, ldy, columns, next, next_lines); break;
  }
}

// Bytes of L2 per core (sysconf; 1 MiB where the C library does not say).
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return v > 0 ? static_cast<int64_t>(v) : int64_t{1} << 20;
  }();
  return bytes;
}

// Rows per block: all of M while x fits 3/4 of L2 (no block: the panels are then read once);
// else blocks of equal size, each within half of L2, a whole number of row tiles, >= 64 rows.
inline int64_t row_block(int64_t M, int64_t row_bytes, int row_tile) {
  const int64_t l2 = l2_bytes();
  row_bytes = std::max<int64_t>(1, row_bytes);
  if (M * row_bytes <= l2 / 4 * 3) return std::max<int64_t>(M, 1);
  const int64_t tile = row_tile == 12 || row_tile == 14 ? row_tile : kRowTile;
  const int64_t most = std::max<int64_t>(64, l2 / 2 / row_bytes);
  const int64_t blocks = (M + most - 1) / most;
  const int64_t rows = (M + blocks - 1) / blocks;
  return std::min(M, (rows + tile - 1) / tile * tile);
}

// Elements of one packed panel of a K-column weight, and its cache lines (a k-step is 2 lines).
template <typename T>
constexpr int64_t panel_elements(int64_t K) {
  return (K + kStep<T> - 1) / kStep<T> * kStep<T> * kPanel;
}
template <typename T>
constexpr int64_t panel_lines(int64_t K) {
  return 2 * ((K + kStep<T> - 1) / kStep<T>);
}

// The first of thread t's panels, of nt threads: each takes one contiguous range.
inline int64_t first_panel(int64_t panels, int t, int nt) { return panels * t / nt; }

// The weight the next call multiplies, as its caller expects it (pagoda_platform_cpu.gemm keeps the
// order its layers ran in): each thread's last panel pulls in the first panel that thread takes
// there, so a call no longer starts on a panel from memory (SmolLM2's 120 decoder matrices in
// order, 32 rows, fp32, 2 Zen 5 threads, interleaved: 14.59 -> 14.18-14.21 ms). A stale or wrong
// guess costs only the lines read; a prefetch never faults.
template <typename T>
struct Follower {
  const T* packed = nullptr;  // nullptr: none known
  int64_t panels = 0;
  int64_t K = 0;
};

// y [M, N] = x W^T (+ bias); with kSiluAndMul, N is the output's columns (half the packed weight's).
template <typename T, Epilogue E = Epilogue::kStore>
void gemm(const T* x, int64_t ldx, int64_t M, int64_t K, const T* packed, int64_t panels, const float* bias, T* y,
          int64_t N, int max_threads, int row_tile, Follower<T> follower = {}) {
  constexpr int64_t out_panel = E == Epilogue::kSiluAndMul ? kPanel / 2 : kPanel;  // output columns a panel
  const int64_t panel_elems = panel_elements<T>(K);
  const int64_t own_lines = panel_lines<T>(K);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads, panels)));
  // Rows in blocks whose x fits half of L2: each panel runs over a block while the block stays in
  // L2, where running every row over each panel would stream all of x from L3 once per panel
  // (x of 4,096 rows x 576 bf16 is 4.7 MB; that took the 4,096-row case below oneDNN).
  const int64_t block = row_block(M, K * static_cast<int64_t>(sizeof(T)), row_tile);
  auto run = [&](int64_t p0, int64_t p1, int t, int nt) {
    // after this thread's last panel: the first one it takes in the next call, if that call's split is known
    const T* after = nullptr;
    int64_t after_lines = 0;
    const int follower_threads = static_cast<int>(std::min<int64_t>(max_threads, follower.panels));
    if (follower.packed != nullptr && follower_threads == nt) {
      after = follower.packed + first_panel(follower.panels, t, nt) * panel_elements<T>(follower.K);
      after_lines = panel_lines<T>(follower.K);
    }
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t mb = std::min(block, M - m0);
      const bool last_block = m0 + block >= M;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * out_panel;
        const T* next = p + 1 < p1 ? packed + (p + 1) * panel_elems : last_block ? after : packed + p0 * panel_elems;
        rows<T, E>(x + m0 * ldx, ldx, mb, K, packed + p * panel_elems, bias == nullptr ? nullptr : bias + p * kPanel,
             y + m0 * N + n0, N, std::min(out_panel, N - n0), row_tile, next,
             p + 1 < p1 || !last_block ? own_lines : after_lines);
      }
    }
  };
  if (threads == 1) {
    run(0, panels, 0, 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    // One contiguous range of panels per thread: its share of the weight, read once.
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    run(first_panel(panels, t, nt), first_panel(panels, t + 1, nt), t, nt);
  }
}

// gemm with the entry points' epilogue code: 1 SiLU-and-mul, anything else a plain store.
template <typename T>
void gemm_with_epilogue(const T* x, int64_t ldx, int64_t M, int64_t K, const T* packed, int64_t panels,
                        const float* bias, T* y, int64_t N, int max_threads, int row_tile, Follower<T> follower,
                        int epilogue) {
  if (epilogue == 1) {
    gemm<T, Epilogue::kSiluAndMul>(x, ldx, M, K, packed, panels, bias, y, N, max_threads, row_tile, follower);
  } else {
    gemm<T>(x, ldx, M, K, packed, panels, bias, y, N, max_threads, row_tile, follower);
  }
}

#endif  // PAGODA_GEMM_FP32

constexpr int kFloat32 = 0, kBFloat16 = 1;

bool supported(int dtype) {
#if defined(PAGODA_GEMM_FP32)
  if (dtype == kFloat32) return true;
#endif
#if defined(PAGODA_GEMM_BF16)
  if (dtype == kBFloat16) return true;
#endif
  return false;
}

// [N, K] -> [ceil(N/32), steps, 32, step] (step = 2 for bf16, 1 for fp32) into a zeroed dst.
template <typename T>
void pack(const T* src, T* dst, int64_t N, int64_t K, int threads) {
  constexpr int64_t step = kStep<T>;
  const int64_t steps = (K + step - 1) / step;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  pagoda::parallel_for(0, panels, 1, threads, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, n1 = std::min(N, n0 + kPanel);
      T* out = dst + p * steps * kPanel * step;
      for (int64_t n = n0; n < n1; ++n) {
        const T* row = src + n * K;
        for (int64_t k = 0; k < K; ++k) out[((k / step) * kPanel + (n - n0)) * step + k % step] = row[k];
      }
    }
  });
}

// The CPU's multiply-add peak: each thread runs kChains independent register-only chains of the
// kernel's own instruction (vfmadd231ps or vdpbf16ps) for `iters` rounds. 16 chains cover the
// latency x pipes of every AVX-512 core (4-6 cycles x 2 pipes). GFLOP/s over all threads.
constexpr int kChains = 16;

#if defined(PAGODA_GEMM_FP32)
template <typename V, typename A>
double peak(int64_t iters, int threads, A a, A b, double flops_per_op) {
  double total_seconds = 0.0;
  float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(max : total_seconds) reduction(+ : sink)
  {
    __m512 acc[kChains];
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j) * 1e-3f);
#pragma omp barrier
    const double start = omp_get_wtime();
    for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kChains; ++j) acc[j] = madd(acc[j], a, b);
    }
    total_seconds = omp_get_wtime() - start;
    for (int j = 1; j < kChains; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
    sink += _mm512_reduce_add_ps(acc[0]);
  }
  volatile float keep = sink;  // the chains' result is used: the loop cannot be dropped
  (void)keep;
  return static_cast<double>(threads) * static_cast<double>(iters) * kChains * flops_per_op / total_seconds / 1e9;
}
#endif

}  // namespace pagoda_gemm

// GFLOP/s of the dtype's multiply-add instruction on `threads` threads (0.0 where this build lacks it).
PAGODA_EXPORT double pagoda_gemm_peak(int dtype, int64_t iters, int threads) {
#if defined(PAGODA_GEMM_FP32)
  if (dtype == pagoda_gemm::kFloat32) {
    return pagoda_gemm::peak<__m512>(iters, threads, _mm512_set1_ps(1.0f), _mm512_set1_ps(1e-7f), 32.0);
  }
#endif
#if defined(PAGODA_GEMM_BF16)
  if (dtype == pagoda_gemm::kBFloat16) {
    return pagoda_gemm::peak<__m512i>(iters, threads, _mm512_set1_epi32(0x3f803f80), _mm512_set1_epi32(0x33d633d6), 64.0);
  }
#endif
  (void)dtype, (void)iters, (void)threads;
  return 0.0;
}

PAGODA_EXPORT int pagoda_gemm_supports(int dtype) { return pagoda_gemm::supported(dtype) ? 1 : 0; }

PAGODA_EXPORT void pagoda_gemm_pack_f32(const float* weight, float* packed, int64_t N, int64_t K, int threads) {
  pagoda_gemm::pack(weight, packed, N, K, threads);
}
PAGODA_EXPORT void pagoda_gemm_pack_bf16(const uint16_t* weight, uint16_t* packed, int64_t N, int64_t K, int threads) {
  pagoda_gemm::pack(weight, packed, N, K, threads);
}

// y [M, N] (rows N apart) = x [M, K] (rows ldx apart) times the packed weight of `panels` panels, plus
// bias (float32, padded to panels * 32; may be null). next_packed / next_panels / next_K: the packed
// weight the caller expects to multiply next (null: none), for its first panels to be prefetched.
// epilogue 1: the weight is packed for SiLU-and-mul (Epilogue::kSiluAndMul) and y is [M, N] of
// silu(gate) * up. Returns -1 where this build lacks the instructions.
PAGODA_EXPORT int pagoda_gemm_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* packed, int64_t panels,
                                  const float* bias, float* y, int64_t N, int threads, int row_tile,
                                  const float* next_packed, int64_t next_panels, int64_t next_K, int epilogue) {
#if defined(PAGODA_GEMM_FP32)
  pagoda_gemm::gemm_with_epilogue(x, ldx, M, K, packed, panels, bias, y, N, threads, row_tile,
                                  pagoda_gemm::Follower<float>{next_packed, next_panels, next_K}, epilogue);
  return 0;
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)packed, (void)panels, (void)bias, (void)y, (void)N, (void)threads;
  (void)row_tile, (void)next_packed, (void)next_panels, (void)next_K, (void)epilogue;
  return -1;
#endif
}
PAGODA_EXPORT int pagoda_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* packed,
                                   int64_t panels, const float* bias, uint16_t* y, int64_t N, int threads,
                                   int row_tile, const uint16_t* next_packed, int64_t next_panels, int64_t next_K,
                                   int epilogue) {
#if defined(PAGODA_GEMM_BF16)
  pagoda_gemm::gemm_with_epilogue(x, ldx, M, K, packed, panels, bias, y, N, threads, row_tile,
                                  pagoda_gemm::Follower<uint16_t>{next_packed, next_panels, next_K}, epilogue);
  return 0;
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)packed, (void)panels, (void)bias, (void)y, (void)N, (void)threads;
  (void)row_tile, (void)next_packed, (void)next_panels, (void)next_K, (void)epilogue;
  return -1;
#endif
}

// The entry points as a Python module (pagoda/python.h): one cheap call each from the wrappers.
PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_gemm_supports),
                     PAGODA_FUNCTION(pagoda_gemm_peak),
                     PAGODA_FUNCTION(pagoda_gemm_pack_f32),
                     PAGODA_FUNCTION(pagoda_gemm_pack_bf16),
                     PAGODA_FUNCTION(pagoda_gemm_f32),
                     PAGODA_FUNCTION(pagoda_gemm_bf16))
